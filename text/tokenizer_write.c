/* tokenizer_write.c: kvf_text_tokenizer_write_default, a small but real byte-level BPE
 * tokenizer for `kvfleet gen-model`: merges learned deterministically from a built-in English
 * sample (classic BPE training: merge the most frequent adjacent pair, ties to the smallest
 * ids), plus BOS/EOS/ChatML special tokens. The model weights are gen-model's business. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer_internal.h"

/* Written for kvfleet; any English prose would do. */
static const char sample_text[] =
    "The little harbour town woke early on market days. Before the sun had cleared the hills, "
    "the fishing boats were already coming back in, their decks stacked with crates of silver "
    "fish, and the gulls followed them in long, noisy circles. Along the quay the traders set "
    "out their tables: bread that was still warm, cheese wrapped in cloth, apples from the "
    "orchards above the valley, and jars of honey that caught the light like small lamps.\n\n"
    "Maria ran the bakery at the corner of the square. She had learned the trade from her "
    "grandmother, who used to say that good bread needs only four things: flour, water, salt "
    "and patience. Every morning Maria started the ovens at four o'clock, shaped the loaves by "
    "hand, and wrote the day's prices on a board by the door. People came from the villages "
    "around to buy her rye bread, and in the winter there was always a queue outside, even in "
    "the rain.\n\n"
    "\"What will you have today?\" she asked a boy who stood on his toes to see over the counter.\n"
    "\"Two rolls, please, and one of those cakes with the cherries on top,\" he said, counting his "
    "coins carefully. \"My father says they are the best in the country.\"\n"
    "\"Your father is a wise man,\" Maria laughed, and she put an extra roll into the bag.\n\n"
    "In the afternoon the square grew quiet. The old men played cards under the plane trees, "
    "children chased each other between the fountains, and the cats slept on the warm stones of "
    "the church steps. A teacher walked past with a class of twenty students, explaining how the "
    "town had been built: first the harbour wall, then the market hall, then the houses that "
    "climbed the hill one street at a time. The students wrote notes and asked questions about "
    "the ships, the storms and the lighthouse on the rocks.\n\n"
    "When the evening came, the lights were turned on one by one. The smell of cooking drifted "
    "out of open windows, and somewhere a radio played an old song about the sea. The boats "
    "would go out again before dawn. Maria cleaned her tables, counted the money, and wrote a "
    "list for the next day: more flour, more sugar, and a new sign for the window, because the "
    "old one had faded in the summer sun. Then she locked the door, looked at the stars over "
    "the water, and walked home slowly, thinking about nothing at all.\n\n"
    "Numbers matter too: in 2023 the town had 4,512 people, 37 boats and 12 shops; by 2024 "
    "there were 4,598 people and 15 shops. Prices rose by 3.5% and the bakery sold 180 loaves "
    "a day. Questions? Write to the office at 10 Harbour Street, or call 555-0100 between 9:00 "
    "and 17:00 from Monday to Friday.\n";

static const char *const specials[4] = {"<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"};

static const char chat_template[] =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

typedef struct word {
    int32_t *sym;
    size_t n;
    int64_t count;
} word;

typedef struct trainer {
    word *words;
    size_t n_words;
    char **str; /* [n_tok] token strings (byte-level form) */
    size_t n_tok, cap_tok;
    int32_t (*merges)[2];
    size_t n_merges;
} trainer;

static kvf_status add_token(trainer *t, char *s)
{
    if (t->n_tok == t->cap_tok) {
        size_t cap = t->cap_tok ? t->cap_tok * 2 : 512;
        char **p = realloc(t->str, cap * sizeof *p);
        if (!p)
            return KVF_ERR_NOMEM;
        t->str = p;
        t->cap_tok = cap;
    }
    t->str[t->n_tok++] = s;
    return KVF_OK;
}

/* Splits the sample with the GPT-2 regex and counts each distinct word (first-seen order). */
static kvf_status collect_words(trainer *t, kvf_err *err)
{
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)kvf_text_tok_gpt2_regex, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &code, &off, NULL);
    pcre2_match_data *md = re ? pcre2_match_data_create_from_pattern(re, NULL) : NULL;
    size_t cap = 0;
    kvf_status st = KVF_OK;
    if (!re || !md) {
        st = kvf_err_set(err, KVF_ERR_INTERNAL, "tokenizer: cannot compile the pre-tokenizer regex");
        goto done;
    }
    size_t n = sizeof sample_text - 1, start = 0;
    while (start < n && pcre2_match(re, (PCRE2_SPTR)sample_text, n, start, 0, md, NULL) > 0) {
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {
            start = ms + 1;
            continue;
        }
        size_t i;
        for (i = 0; i < t->n_words; i++) {
            word *w = &t->words[i];
            if (w->n != me - ms)
                continue;
            size_t k = 0;
            while (k < w->n && w->sym[k] == (uint8_t)sample_text[ms + k])
                k++;
            if (k == w->n)
                break;
        }
        if (i < t->n_words) {
            t->words[i].count++;
        } else {
            if (t->n_words == cap) {
                cap = cap ? cap * 2 : 256;
                word *p = realloc(t->words, cap * sizeof *p);
                if (!p) {
                    st = kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
                    goto done;
                }
                t->words = p;
            }
            word *w = &t->words[t->n_words];
            w->n = me - ms;
            w->count = 1;
            w->sym = malloc(w->n * sizeof *w->sym);
            if (!w->sym) {
                st = kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
                goto done;
            }
            for (size_t k = 0; k < w->n; k++)
                w->sym[k] = (uint8_t)sample_text[ms + k];
            t->n_words++;
        }
        start = me;
    }
done:
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return st;
}

typedef struct pair_count {
    uint64_t key;
    int64_t count;
} pair_count;

/* One training step: the most frequent pair (ties: smallest key), or false when none is left. */
static bool best_pair(trainer *t, pair_count *tab, size_t cap, uint64_t *key_out)
{
    for (size_t i = 0; i < cap; i++)
        tab[i].key = UINT64_MAX, tab[i].count = 0;
    uint64_t best = UINT64_MAX;
    int64_t best_n = 0;
    for (size_t w = 0; w < t->n_words; w++) {
        const word *wd = &t->words[w];
        for (size_t k = 0; k + 1 < wd->n; k++) {
            uint64_t key = ((uint64_t)(uint32_t)wd->sym[k] << 32) | (uint32_t)wd->sym[k + 1];
            size_t i = (size_t)((key * 0x9E3779B97F4A7C15ULL) >> 20) & (cap - 1);
            while (tab[i].key != UINT64_MAX && tab[i].key != key)
                i = (i + 1) & (cap - 1);
            tab[i].key = key;
            tab[i].count += wd->count;
            if (tab[i].count > best_n || (tab[i].count == best_n && key < best)) {
                best_n = tab[i].count;
                best = key;
            }
        }
    }
    *key_out = best;
    return best_n > 0;
}

static int32_t find_str(const trainer *t, const char *s)
{
    for (size_t i = t->n_tok; i-- > 0;)
        if (strcmp(t->str[i], s) == 0)
            return (int32_t)i;
    return -1;
}

/* Learns merges until the vocabulary has n_bpe tokens or the sample has no pair left. */
static kvf_status train(trainer *t, size_t n_bpe, kvf_err *err)
{
    size_t total = 0;
    for (size_t w = 0; w < t->n_words; w++)
        total += t->words[w].n;
    size_t cap = 16;
    while (cap < total * 2)
        cap <<= 1;
    pair_count *tab = malloc(cap * sizeof *tab);
    t->merges = malloc((n_bpe + 1) * sizeof *t->merges);
    if (!tab || !t->merges) {
        free(tab);
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
    }
    uint64_t key;
    while (t->n_tok < n_bpe && best_pair(t, tab, cap, &key)) {
        int32_t a = (int32_t)(key >> 32), b = (int32_t)(uint32_t)key;
        size_t la = strlen(t->str[a]), lb = strlen(t->str[b]);
        char *s = malloc(la + lb + 1);
        if (!s) {
            free(tab);
            return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
        }
        memcpy(s, t->str[a], la);
        memcpy(s + la, t->str[b], lb + 1);
        int32_t id = find_str(t, s);
        if (id < 0) {
            id = (int32_t)t->n_tok;
            if (add_token(t, s) != KVF_OK) {
                free(s);
                free(tab);
                return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
            }
        } else {
            free(s);
        }
        t->merges[t->n_merges][0] = a;
        t->merges[t->n_merges++][1] = b;
        if (t->n_merges > n_bpe)
            break;
        for (size_t w = 0; w < t->n_words; w++) { /* apply left to right */
            word *wd = &t->words[w];
            size_t o = 0;
            for (size_t k = 0; k < wd->n; k++) {
                if (k + 1 < wd->n && wd->sym[k] == a && wd->sym[k + 1] == b) {
                    wd->sym[o++] = id;
                    k++;
                } else {
                    wd->sym[o++] = wd->sym[k];
                }
            }
            wd->n = o;
        }
    }
    free(tab);
    return KVF_OK;
}

static kvf_status dump(json_t *j, const char *path, kvf_err *err)
{
    if (!j)
        return kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory building %s", path);
    int rc = json_dump_file(j, path, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(j);
    return rc == 0 ? KVF_OK : kvf_err_set(err, KVF_ERR_IO, "tokenizer: cannot write %s", path);
}

static json_t *added_token(int32_t id, const char *content)
{
    return json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", id, "content", content, "single_word", 0, "lstrip", 0,
                     "rstrip", 0, "normalized", 0, "special", 1);
}

kvf_status kvf_text_tokenizer_write_default(const char *dir, int32_t vocab_size, kvf_err *err)
{
    if (vocab_size < KVF_TEXT_TOKENIZER_MIN_VOCAB || vocab_size > KVF_TEXT_TOK_MAX_ID)
        return kvf_err_set(err, KVF_ERR_INVALID, "tokenizer: vocab size %d is not supported (use %d..%d)", vocab_size,
                           KVF_TEXT_TOKENIZER_MIN_VOCAB, KVF_TEXT_TOK_MAX_ID);
    trainer t = {0};
    kvf_status st = KVF_OK;
    for (int b = 0; b < 256 && st == KVF_OK; b++) {
        char *s = malloc(4);
        if (!s) {
            st = KVF_ERR_NOMEM;
            break;
        }
        s[kvf_text_utf8_put(kvf_text_tok_byte_to_cp((uint8_t)b), s)] = 0;
        st = add_token(&t, s);
    }
    if (st != KVF_OK) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "tokenizer: out of memory");
        goto done;
    }
    if ((st = collect_words(&t, err)) != KVF_OK || (st = train(&t, (size_t)vocab_size - 4, err)) != KVF_OK)
        goto done;

    /* tokenizer.json */
    json_t *vocab = json_object(), *merges = json_array(), *added = json_array();
    for (size_t i = 0; i < t.n_tok; i++)
        json_object_set_new(vocab, t.str[i], json_integer((json_int_t)i));
    for (size_t i = 0; i < t.n_merges; i++)
        json_array_append_new(merges, json_pack("[s,s]", t.str[t.merges[i][0]], t.str[t.merges[i][1]]));
    int32_t id = (int32_t)t.n_tok;
    for (int i = 0; i < 4; i++, id++)
        json_array_append_new(added, added_token(id, specials[i]));
    /* The rest of the vocabulary: words glued from two learned tokens. No merge makes them, so
     * encoding never produces them, but they decode to text, so a random-weight model prints
     * word salad rather than nothing. When the pairs run out, reserved special tokens fill. */
    size_t n_learned = t.n_tok > 256 ? t.n_tok - 256 : 0;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (int64_t tries = 0; id < vocab_size && n_learned > 0 && tries < 8 * (int64_t)vocab_size; tries++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        const char *a = t.str[256 + (rng >> 33) % n_learned];
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        const char *b = t.str[256 + (rng >> 33) % n_learned];
        char glued[256];
        if ((size_t)snprintf(glued, sizeof glued, "%s%s", a, b) >= sizeof glued || json_object_get(vocab, glued))
            continue;
        json_object_set_new(vocab, glued, json_integer(id++));
    }
    for (int32_t r = 0; id < vocab_size; r++, id++) {
        char name[64];
        snprintf(name, sizeof name, "<|reserved_special_token_%d|>", r);
        json_array_append_new(added, added_token(id, name));
    }
    int32_t bos = (int32_t)t.n_tok;
    json_t *bytelevel = json_pack("{s:s,s:b,s:b,s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                                  "use_regex", 1);
    json_t *root = json_pack(
        "{s:s,s:n,s:n,s:o,s:{s:s},s:O,s:{s:s,s:[{s:{s:s,s:i}},{s:{s:s,s:i}}],s:[{s:{s:s,s:i}},{s:{s:s,s:i}},"
        "{s:{s:s,s:i}},{s:{s:s,s:i}}],s:{s:{s:s,s:[i],s:[s]}}},s:O,s:{s:s,s:n,s:n,s:n,s:n,s:b,s:b,s:b,s:o,s:o}}",
        "version", "1.0", "truncation", "padding", "added_tokens", added, "normalizer", "type", "NFC",
        "pre_tokenizer", bytelevel, "post_processor", "type", "TemplateProcessing", "single", "SpecialToken", "id",
        specials[0], "type_id", 0, "Sequence", "id", "A", "type_id", 0, "pair", "SpecialToken", "id", specials[0],
        "type_id", 0, "Sequence", "id", "A", "type_id", 0, "SpecialToken", "id", specials[0], "type_id", 1,
        "Sequence", "id", "B", "type_id", 1, "special_tokens", specials[0], "id", specials[0], "ids", bos, "tokens",
        specials[0], "decoder", bytelevel, "model", "type", "BPE", "dropout", "unk_token",
        "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0, "byte_fallback", 0, "ignore_merges", 0,
        "vocab", vocab, "merges", merges);
    json_decref(bytelevel);
    char path[4200];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if ((st = dump(root, path, err)) != KVF_OK)
        goto done;

    /* tokenizer_config.json */
    json_t *cfg = json_pack("{s:b,s:b,s:s,s:s,s:s,s:n,s:b,s:i,s:s,s:s}", "add_bos_token", 1, "add_eos_token", 0,
                            "bos_token", specials[0], "eos_token", specials[1], "pad_token", specials[1], "unk_token",
                            "clean_up_tokenization_spaces", 0, "model_max_length", 4096, "tokenizer_class",
                            "PreTrainedTokenizerFast", "chat_template", chat_template);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    st = dump(cfg, path, err);
done:
    for (size_t i = 0; i < t.n_words; i++)
        free(t.words[i].sym);
    free(t.words);
    for (size_t i = 0; i < t.n_tok; i++)
        free(t.str[i]);
    free(t.str);
    free(t.merges);
    return st;
}
