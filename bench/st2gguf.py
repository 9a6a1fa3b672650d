#!/usr/bin/env python3
"""st2gguf.py: a kvfleet gen-model directory (Llama, F32 safetensors, byte-level BPE
tokenizer.json) -> one F32 GGUF v3 file llama.cpp loads. Python stdlib only (no numpy).
Used by bench/llamacpp_side.sh only: kvfleet itself never reads GGUF.
Usage: st2gguf.py MODEL_DIR OUT.gguf
Q and K rows are permuted from Hugging Face's rotate-half order to GGML's interleaved
RoPE order, as llama.cpp's own convert_hf_to_gguf.py does."""
import json, mmap, os, struct, sys

T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9
ALIGN = 32


def s_bytes(s):
    b = s.encode()
    return struct.pack('<Q', len(b)) + b


def kv(key, typ, val):
    out = s_bytes(key) + struct.pack('<I', typ)
    if typ == T_U32:
        out += struct.pack('<I', val)
    elif typ == T_I32:
        out += struct.pack('<i', val)
    elif typ == T_F32:
        out += struct.pack('<f', val)
    elif typ == T_BOOL:
        out += struct.pack('<B', 1 if val else 0)
    elif typ == T_STR:
        out += s_bytes(val)
    else:
        et, items = val
        out += struct.pack('<IQ', et, len(items))
        if et == T_STR:
            out += b''.join(s_bytes(x) for x in items)
        elif et == T_I32:
            out += struct.pack('<%di' % len(items), *items)
    return out


def main():
    src, dst = sys.argv[1], sys.argv[2]
    cfg = json.load(open(os.path.join(src, 'config.json')))
    tok = json.load(open(os.path.join(src, 'tokenizer.json')))
    n_vocab = cfg['vocab_size']
    tokens = ['[PAD%d]' % i for i in range(n_vocab)]
    types = [5] * n_vocab  # unused until named
    for t, i in tok['model']['vocab'].items():
        tokens[i] = t
        types[i] = 1
    for a in tok.get('added_tokens', []):
        tokens[a['id']] = a['content']
        types[a['id']] = 3 if a.get('special') else 4
    merges = [m if isinstance(m, str) else ' '.join(m) for m in tok['model'].get('merges', [])]
    eos = cfg['eos_token_id']
    eos = eos[0] if isinstance(eos, list) else eos
    hd = cfg.get('head_dim') or cfg['hidden_size'] // cfg['num_attention_heads']
    meta = [
        kv('general.architecture', T_STR, 'llama'),
        kv('general.name', T_STR, os.path.basename(os.path.abspath(src))),
        kv('general.file_type', T_U32, 0),
        kv('general.alignment', T_U32, ALIGN),
        kv('llama.context_length', T_U32, cfg['max_position_embeddings']),
        kv('llama.embedding_length', T_U32, cfg['hidden_size']),
        kv('llama.block_count', T_U32, cfg['num_hidden_layers']),
        kv('llama.feed_forward_length', T_U32, cfg['intermediate_size']),
        kv('llama.attention.head_count', T_U32, cfg['num_attention_heads']),
        kv('llama.attention.head_count_kv', T_U32, cfg['num_key_value_heads']),
        kv('llama.rope.dimension_count', T_U32, hd),
        kv('llama.rope.freq_base', T_F32, float(cfg.get('rope_theta', 10000.0))),
        kv('llama.attention.layer_norm_rms_epsilon', T_F32, float(cfg['rms_norm_eps'])),
        kv('llama.vocab_size', T_U32, n_vocab),
        kv('tokenizer.ggml.model', T_STR, 'gpt2'),
        kv('tokenizer.ggml.pre', T_STR, 'default'),
        kv('tokenizer.ggml.tokens', T_ARR, (T_STR, tokens)),
        kv('tokenizer.ggml.token_type', T_ARR, (T_I32, types)),
        kv('tokenizer.ggml.merges', T_ARR, (T_STR, merges)),
        kv('tokenizer.ggml.bos_token_id', T_U32, cfg['bos_token_id']),
        kv('tokenizer.ggml.eos_token_id', T_U32, eos),
        kv('tokenizer.ggml.add_bos_token', T_BOOL, True),
    ]

    f = open(os.path.join(src, 'model.safetensors'), 'rb')
    hlen = struct.unpack('<Q', f.read(8))[0]
    hdr = json.loads(f.read(hlen))
    base = 8 + hlen
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    names = {'model.embed_tokens.weight': 'token_embd.weight',
             'model.norm.weight': 'output_norm.weight', 'lm_head.weight': 'output.weight'}
    per = {'input_layernorm': 'attn_norm', 'post_attention_layernorm': 'ffn_norm',
           'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k',
           'self_attn.v_proj': 'attn_v', 'self_attn.o_proj': 'attn_output',
           'mlp.gate_proj': 'ffn_gate', 'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down'}
    tensors = []  # (gguf name, shape, src offset, nbytes, permute heads or 0)
    for k, v in hdr.items():
        if k == '__metadata__':
            continue
        if v['dtype'] != 'F32':
            sys.exit('st2gguf: %s is %s (only F32 models)' % (k, v['dtype']))
        if k in names:
            g = names[k]
        else:
            parts = k.split('.')  # model.layers.N.<a>.<b>.weight
            g = 'blk.%s.%s.weight' % (parts[2], per['.'.join(parts[3:-1])])
        heads = 0
        if k.endswith('q_proj.weight'):
            heads = cfg['num_attention_heads']
        elif k.endswith('k_proj.weight'):
            heads = cfg['num_key_value_heads']
        o0, o1 = v['data_offsets']
        tensors.append((g, v['shape'], base + o0, o1 - o0, heads))

    info = b''
    off = 0
    for g, shape, _, nb, _ in tensors:
        dims = list(reversed(shape))
        info += s_bytes(g) + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', d) for d in dims)
        info += struct.pack('<IQ', 0, off)
        off += (nb + ALIGN - 1) // ALIGN * ALIGN
    head = b'GGUF' + struct.pack('<IQQ', 3, len(tensors), len(meta)) + b''.join(meta) + info
    with open(dst, 'wb') as o:
        o.write(head)
        o.write(b'\0' * ((-len(head)) % ALIGN))
        for i, (g, shape, so, nb, heads) in enumerate(tensors):
            data = mm[so:so + nb]
            if heads:
                rows, cols = shape
                rb = cols * 4
                hdim = rows // heads
                out = bytearray(nb)
                for h in range(heads):
                    for r in range(hdim):  # new row 2k+j = old row j*hdim/2 + k
                        k, j = r // 2, r % 2
                        src_r = h * hdim + j * (hdim // 2) + k
                        dst_r = h * hdim + r
                        out[dst_r * rb:(dst_r + 1) * rb] = data[src_r * rb:(src_r + 1) * rb]
                data = bytes(out)
            o.write(data)
            o.write(b'\0' * ((-nb) % ALIGN))
            if sys.stderr.isatty():
                print('\rst2gguf: %d/%d tensors' % (i + 1, len(tensors)), end='', file=sys.stderr)
    print('\nst2gguf: wrote %s (%d tensors, %d bytes)' % (dst, len(tensors), os.path.getsize(dst)),
          file=sys.stderr)


if __name__ == '__main__':
    main()
