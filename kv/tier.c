/* tier.c: the host and disk KV tiers of kv/tier.h. Each tier is a set of fixed slots with an
 * LRU list, a free stack and an open-addressing hash index (as the pool's); the host tier keeps
 * block bytes in one allocation, the disk tier in one file of slots written with pwrite and read
 * back with pread, each checked against its checksummed header. The pool decides when to call.
 * Promotions go through a copy thread (a bounded job queue in, a completion queue out, one mutex):
 * the thread only reads a pinned ("busy") slot and writes one pool block through from_host;
 * every change of tier state (slots, LRU, index, events, stats) stays on the pool's thread. */
#include "kv/tier.h"

#include <sys/file.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/hash.h"
#include "common/log.h"
#include "common/time.h"
#include "kv/tier_internal.h"

#define DISK_MAGIC 0x3152454954564b46ULL /* "FKVTIER1" little-endian */
#define DISK_FILE "kvfleet-kv-tier.bin"

/* The header at the start of every disk slot, followed by tokens [bs] and the block bytes. */
typedef struct disk_hdr {
    uint64_t magic;
    uint64_t hash, parent;
    int64_t block_bytes;
    int32_t n_tokens, slot;
    uint64_t check; /* XXH3 of header (check = 0), tokens and bytes */
} disk_hdr;

typedef struct tier_slot {
    uint64_t hash, parent;
    int64_t stamp;      /* when it came in (LRU order) */
    int32_t prev, next; /* LRU links while used, else -1 */
    int32_t free_pos;   /* index in the free stack while free, else -1 */
    uint8_t used;
    uint8_t busy;       /* used, pinned by a promotion job: off the LRU and the index */
} tier_slot;

typedef struct tier_level {
    kvf_kv_tier_kind kind;
    int32_t n;
    tier_slot *slot;  /* [n] */
    int32_t *tokens;  /* [n][bs] */
    int32_t *free_stack; /* [n] */
    int32_t n_free;
    int32_t n_fresh;  /* slots [n_fresh, n) were never used: free, and not yet on the stack (their
                       * metadata is calloc's untouched zero pages until first taken) */
    int32_t head, tail, n_used; /* head: least recently used; n_used counts busy slots */
    int32_t n_busy;
    int32_t *map;     /* [mask + 1] slot id + 1, or 0: empty (calloc'd, so never touched whole) */
    uint64_t mask;
} tier_level;

enum { JOB_FREE = 0, JOB_BEGUN, JOB_QUEUED, JOB_DONE, JOB_FAILED };

/* One promotion: tier slot -> pool block. The pool's thread writes it until it is queued and
 * alone reads live and stale; the copy thread copies tier, slot, block, hash and parent under mu
 * when it takes the job, and writes state, t1, corrupt and why under mu, which the pool's
 * thread reads only under mu (reap). */
typedef struct tier_job {
    bool live;    /* begun and not yet reaped (pool thread only) */
    int32_t state;
    kvf_kv_tier_kind tier;
    int32_t slot, block;
    uint64_t hash, parent;
    bool stale;   /* the hash went elsewhere meanwhile (the pool computed it): not registered */
    bool corrupt; /* the disk read was refused */
    int64_t t0, t1; /* submitted (the pool block taken), finished (ns) */
    char why[200];
} tier_job;

#define DEFAULT_MAX_COPIES 256

struct kvf_kv_tier {
    kvf_kv_tier_cfg cfg;
    kvf_kv_layout layout;
    int64_t block_bytes;
    int32_t bs;
    tier_level lv[3]; /* [HOST], [DISK]; [0] unused */
    char *host_mem;   /* [n_host][block_bytes] */
    int fd;           /* disk file, -1 without */
    int dirfd;        /* its directory, locked (flock) while the tier lives; -1 without */
    char path[PATH_MAX];
    int64_t slot_bytes; /* disk slot: header + tokens + bytes */
    char *io;         /* [slot_bytes]: one disk slot in flight */
    char *stage;      /* [block_bytes]: a disk block on its way up */
    kvf_kv_event_fn on_event;
    void *event_ctx;
    bool attached;
    kvf_kv_tier_stats st;
    /* the copy thread (async promotions); pool memory from attach */
    const kvf_kv_mem_ops *mem;
    void *mem_ctx, *base;
    bool thread_on, stop, sync_made;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    int32_t q;             /* max_copies */
    tier_job *job;         /* [q] */
    int32_t *job_free;     /* [q] free job ids (pool thread) */
    int32_t n_job_free, n_jobs;
    int32_t *qring, qh, qn; /* [q] queued for the thread (mu) */
    int32_t *dring, dh, dn; /* [q] finished, to reap (mu) */
    char *cio;             /* [slot_bytes]: the copy thread's disk buffer */
};

/* ---- one level: slots, LRU, index ---------------------------------------------------------- */

static kvf_status level_init(tier_level *l, kvf_kv_tier_kind kind, int64_t n, int32_t bs)
{
    l->kind = kind;
    l->n = (int32_t)n;
    l->head = l->tail = -1;
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n)
        cap <<= 1;
    l->mask = cap - 1;
    l->slot = calloc((size_t)n, sizeof *l->slot);
    l->tokens = calloc((size_t)n * (size_t)bs, sizeof *l->tokens);
    l->free_stack = calloc((size_t)n, sizeof *l->free_stack);
    l->map = calloc(cap, sizeof *l->map);
    if (!l->slot || !l->tokens || !l->free_stack || !l->map)
        return KVF_ERR_NOMEM;
    /* no slot is initialised here: level_take_free hands out never-used slots in order (0, 1,
     * ...) once the stack is empty, so a large tier touches only the slots it ever uses */
    return KVF_OK;
}

static void level_fini(tier_level *l)
{
    free(l->slot);
    free(l->tokens);
    free(l->free_stack);
    free(l->map);
    memset(l, 0, sizeof *l);
}

static int32_t map_find(const tier_level *l, uint64_t h)
{
    if (l->n == 0)
        return -1;
    for (uint64_t i = h & l->mask;; i = (i + 1) & l->mask) {
        int32_t id = l->map[i] - 1;
        if (id < 0 || l->slot[id].hash == h)
            return id;
    }
}

static void map_insert(tier_level *l, int32_t id)
{
    uint64_t i = l->slot[id].hash & l->mask;
    while (l->map[i] > 0)
        i = (i + 1) & l->mask;
    l->map[i] = id + 1;
}

static void map_remove(tier_level *l, int32_t id)
{
    uint64_t i = l->slot[id].hash & l->mask;
    while (l->map[i] != id + 1)
        i = (i + 1) & l->mask;
    uint64_t hole = i; /* backward-shift deletion, as in pool.c */
    for (uint64_t j = (i + 1) & l->mask; l->map[j] > 0; j = (j + 1) & l->mask) {
        uint64_t home = l->slot[l->map[j] - 1].hash & l->mask;
        if (((j - home) & l->mask) >= ((j - hole) & l->mask)) {
            l->map[hole] = l->map[j];
            hole = j;
        }
    }
    l->map[hole] = 0;
}

/* Whether a slot is free (on the stack, or never used). */
static bool level_has_free(const tier_level *l)
{
    return l->n_free > 0 || l->n_fresh < l->n;
}

/* A free slot, off the free stack (not yet used), else the next never-used one; -1 when none. */
static int32_t level_take_free(tier_level *l)
{
    int32_t id;
    if (l->n_free > 0) {
        id = l->free_stack[--l->n_free];
    } else if (l->n_fresh < l->n) {
        id = l->n_fresh++;
        l->slot[id].prev = l->slot[id].next = -1;
    } else {
        return -1;
    }
    l->slot[id].free_pos = -1;
    return id;
}

static void level_push_free(tier_level *l, int32_t id)
{
    l->slot[id].free_pos = l->n_free;
    l->free_stack[l->n_free++] = id;
}

/* Registers a taken slot under hash at the LRU tail. */
static void level_use(tier_level *l, int32_t id, uint64_t hash, uint64_t parent,
                      const int32_t *tokens, int32_t bs, int64_t now)
{
    tier_slot *s = &l->slot[id];
    s->hash = hash;
    s->parent = parent;
    s->stamp = now;
    s->used = 1;
    memcpy(l->tokens + (int64_t)id * bs, tokens, (size_t)bs * sizeof *tokens);
    s->prev = l->tail;
    s->next = -1;
    if (l->tail >= 0)
        l->slot[l->tail].next = id;
    else
        l->head = id;
    l->tail = id;
    l->n_used++;
    map_insert(l, id);
}

/* Takes a used slot out of the index and the LRU list (it stays used). */
static void level_unlink(tier_level *l, int32_t id)
{
    tier_slot *s = &l->slot[id];
    map_remove(l, id);
    if (s->prev >= 0)
        l->slot[s->prev].next = s->next;
    else
        l->head = s->next;
    if (s->next >= 0)
        l->slot[s->next].prev = s->prev;
    else
        l->tail = s->prev;
    s->prev = s->next = -1;
}

/* Unregisters a used slot and puts it back on the free stack. */
static void level_release(tier_level *l, int32_t id)
{
    tier_slot *s = &l->slot[id];
    level_unlink(l, id);
    s->used = 0;
    l->n_used--;
    level_push_free(l, id);
}

static void emit(kvf_kv_tier *t, kvf_kv_event_type type, const tier_level *l, int32_t id)
{
    if (!t->on_event)
        return;
    const tier_slot *s = &l->slot[id];
    kvf_kv_event ev = {.type = type, .hash = s->hash, .parent_hash = s->parent, .block = -1,
                       .tier = (int32_t)l->kind};
    if (type == KVF_KV_EVENT_STORED) {
        ev.tokens = l->tokens + (int64_t)id * t->bs;
        ev.n_tokens = t->bs;
    }
    t->on_event(t->event_ctx, &ev);
}

/* Drops a used slot with a REMOVED event (the hash is gone from every tier). */
static void level_drop(kvf_kv_tier *t, tier_level *l, int32_t id)
{
    emit(t, KVF_KV_EVENT_REMOVED, l, id);
    level_release(l, id);
    t->st.tier[l->kind].dropped++;
}

/* ---- disk slots ---------------------------------------------------------------------------- */

static uint64_t disk_checksum(const kvf_kv_tier *t, const char *slot_buf)
{
    disk_hdr h;
    memcpy(&h, slot_buf, sizeof h);
    h.check = 0;
    return kvf_hash64_concat(&h, sizeof h, slot_buf + sizeof h,
                             (size_t)(t->slot_bytes - (int64_t)sizeof h));
}

/* Writes host slot hs to disk slot ds; false on a short or failed write. */
static bool disk_write(kvf_kv_tier *t, int32_t hs, int32_t ds)
{
    tier_level *host = &t->lv[KVF_KV_TIER_HOST];
    const tier_slot *s = &host->slot[hs];
    disk_hdr h = {.magic = DISK_MAGIC, .hash = s->hash, .parent = s->parent,
                  .block_bytes = t->block_bytes, .n_tokens = t->bs, .slot = ds};
    memcpy(t->io, &h, sizeof h);
    memcpy(t->io + sizeof h, host->tokens + (int64_t)hs * t->bs, (size_t)t->bs * sizeof(int32_t));
    memcpy(t->io + sizeof h + (size_t)t->bs * sizeof(int32_t),
           t->host_mem + (int64_t)hs * t->block_bytes, (size_t)t->block_bytes);
    h.check = disk_checksum(t, t->io);
    memcpy(t->io, &h, sizeof h);
    off_t off = (off_t)ds * t->slot_bytes;
    for (int64_t done = 0; done < t->slot_bytes;) {
        ssize_t n = pwrite(t->fd, t->io + done, (size_t)(t->slot_bytes - done), off + done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            kvf_log(KVF_LOG_WARN, "kv: disk tier %s: write of slot %d failed: %s (block dropped)",
                    t->path, ds, n < 0 ? strerror(errno) : "no progress");
            return false;
        }
        done += n;
    }
    return true;
}

/* Reads disk slot ds into buf [slot_bytes] and checks it against hash, parent and the index's
 * tokens; NULL (with why) on anything that disagrees, else the block bytes inside buf. Runs on
 * the copy thread for a busy slot (whose index entry nobody changes meanwhile). */
static const char *disk_read(kvf_kv_tier *t, char *buf, int32_t ds, uint64_t hash,
                             uint64_t parent, const char **why)
{
    const tier_level *disk = &t->lv[KVF_KV_TIER_DISK];
    off_t off = (off_t)ds * t->slot_bytes;
    int64_t done = 0;
    while (done < t->slot_bytes) {
        ssize_t n = pread(t->fd, buf + done, (size_t)(t->slot_bytes - done), off + done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        done += n;
    }
    if (done != t->slot_bytes)
        return *why = "short read", NULL;
    disk_hdr h;
    memcpy(&h, buf, sizeof h);
    if (h.magic != DISK_MAGIC || h.block_bytes != t->block_bytes || h.n_tokens != t->bs ||
        h.slot != ds)
        return *why = "bad header", NULL;
    if (h.hash != hash || h.parent != parent ||
        memcmp(buf + sizeof h, disk->tokens + (int64_t)ds * t->bs,
               (size_t)t->bs * sizeof(int32_t)) != 0)
        return *why = "hash or tokens differ from the index", NULL;
    if (disk_checksum(t, buf) != h.check)
        return *why = "checksum mismatch", NULL;
    return buf + sizeof h + (size_t)t->bs * sizeof(int32_t);
}

/* Opens the disk tier's directory (made 0700 when missing) into *dirfd_out, and takes its lock:
 * refused when it is not a directory (a symbolic link is not followed), not owned by this
 * process's user, writable by group or others, or locked by another live tier (another worker).
 * Then the tier file is made afresh: a previous run's (or anything planted under its name, a
 * symbolic link included, whose target is untouched) is unlinked, and nothing else in dir is. */
static kvf_status disk_open(const char *dir, int *dirfd_out, int *fd_out, kvf_err *err)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return kvf_err_set(err, KVF_ERR_IO, "kv: --kv-disk-dir=%s cannot be created: %s", dir,
                           strerror(errno));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
        return kvf_err_set(err, KVF_ERR_IO, "kv: --kv-disk-dir=%s cannot be opened: %s%s", dir,
                           strerror(errno), errno == ELOOP || errno == ENOTDIR ?
                           " (it must be a directory, not a symbolic link)" : "");
    kvf_status st;
    struct stat sb;
    if (fstat(dfd, &sb) != 0) {
        st = kvf_err_set(err, KVF_ERR_IO, "kv: --kv-disk-dir=%s: %s", dir, strerror(errno));
        goto close_dir;
    }
    if (!S_ISDIR(sb.st_mode)) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "kv: --kv-disk-dir=%s is not a directory", dir);
        goto close_dir;
    }
    if (sb.st_uid != geteuid()) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "kv: --kv-disk-dir=%s is owned by uid %u, not by "
                         "this process's uid %u (it must be private to this worker)", dir,
                         (unsigned)sb.st_uid, (unsigned)geteuid());
        goto close_dir;
    }
    if (sb.st_mode & (S_IWGRP | S_IWOTH)) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "kv: --kv-disk-dir=%s is writable by group or "
                         "others (mode %03o; it must be private to this worker, e.g. 0700)", dir,
                         (unsigned)(sb.st_mode & 07777));
        goto close_dir;
    }
    if (flock(dfd, LOCK_EX | LOCK_NB) != 0) {
        st = errno == EWOULDBLOCK
                 ? kvf_err_set(err, KVF_ERR_BUSY, "kv: --kv-disk-dir=%s is in use by another "
                               "worker's disk tier (each worker needs its own directory)", dir)
                 : kvf_err_set(err, KVF_ERR_IO, "kv: --kv-disk-dir=%s cannot be locked: %s", dir,
                               strerror(errno));
        goto close_dir;
    }
    /* the lock is ours: a tier file there is a dead run's */
    if (unlinkat(dfd, DISK_FILE, 0) != 0 && errno != ENOENT) {
        st = kvf_err_set(err, KVF_ERR_IO, "kv: --kv-disk-dir=%s: the old %s cannot be removed: %s",
                         dir, DISK_FILE, strerror(errno));
        goto close_dir;
    }
    int fd = openat(dfd, DISK_FILE, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        st = kvf_err_set(err, KVF_ERR_IO, "kv: disk tier file %s/%s cannot be created: %s", dir,
                         DISK_FILE, strerror(errno));
        goto close_dir;
    }
    *dirfd_out = dfd;
    *fd_out = fd;
    return KVF_OK;
close_dir:
    close(dfd); /* (drops the lock, if taken) */
    return st;
}

/* ---- create / destroy ---------------------------------------------------------------------- */

kvf_status kvf_kv_tier_create(const kvf_kv_tier_cfg *cfg, const kvf_kv_layout *layout,
                              kvf_kv_tier **out, kvf_err *err)
{
    if (!cfg || !layout || !out || layout->block_bytes <= 0 || layout->block_size <= 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: tier_create needs a cfg, a layout and an "
                           "out pointer");
    int64_t bb = layout->block_bytes;
    int64_t n_host = cfg->host_bytes / bb;
    if (cfg->host_bytes < 0 || n_host < 1 || n_host > INT32_MAX / 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: host tier of %lld bytes is not allowed "
                           "(one block of %lld bytes up to %lld blocks)",
                           (long long)cfg->host_bytes, (long long)bb, (long long)(INT32_MAX / 2));
    bool disk = cfg->disk_dir && *cfg->disk_dir;
    int64_t slot_bytes = kvf_kv_tier_slot_bytes_for(layout);
    int64_t n_disk = disk ? cfg->disk_bytes / slot_bytes : 0;
    if (disk && (cfg->disk_bytes < 0 || n_disk < 1 || n_disk > INT32_MAX / 2))
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: disk tier of %lld bytes is not allowed "
                           "(one slot of %lld bytes up to %lld slots)", (long long)cfg->disk_bytes,
                           (long long)slot_bytes, (long long)(INT32_MAX / 2));
    if (!disk && cfg->disk_bytes != 0)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: disk tier of %lld bytes has no directory",
                           (long long)cfg->disk_bytes);
    if ((uint64_t)n_host * (uint64_t)bb > (uint64_t)SIZE_MAX / 2)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: host tier of %lld bytes overflows",
                           (long long)cfg->host_bytes);
    /* more than the machine has is refused here, not found by the OOM killer later */
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 && (uint64_t)n_host * (uint64_t)bb >
                                     (uint64_t)pages * (uint64_t)page)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: --kv-host-memory=%lld is more than this "
                           "machine's physical memory (%llu bytes)", (long long)cfg->host_bytes,
                           (unsigned long long)pages * (unsigned long long)page);

    kvf_kv_tier *t = calloc(1, sizeof *t);
    if (!t)
        return kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for the tiers");
    kvf_status st;
    t->cfg = *cfg;
    t->cfg.disk_dir = NULL; /* not kept: the path is */
    t->layout = *layout;
    t->block_bytes = bb;
    t->bs = layout->block_size;
    t->fd = t->dirfd = -1;
    t->slot_bytes = disk ? slot_bytes : 0;
    t->q = cfg->max_copies > 0 ? cfg->max_copies : DEFAULT_MAX_COPIES;
    if (cfg->max_copies < 0 || t->q > (1 << 20)) {
        st = kvf_err_set(err, KVF_ERR_INVALID, "kv: tier max_copies %d is not allowed (0 for %d, "
                         "up to %d)", cfg->max_copies, DEFAULT_MAX_COPIES, 1 << 20);
        goto fail;
    }
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0 ||
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_mutex_init(&t->mu, NULL) != 0) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "kv: tier: cannot make the copy thread's lock");
        goto fail;
    }
    pthread_cond_init(&t->cv_work, &ca);
    pthread_cond_init(&t->cv_done, &ca);
    pthread_condattr_destroy(&ca);
    t->sync_made = true;
    /* the host tier's memory first: when it cannot be had, nothing else was touched */
    if (!(t->host_mem = malloc((size_t)(n_host * bb)))) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "kv: --kv-host-memory=%lld: cannot allocate %lld "
                         "blocks of %lld bytes", (long long)cfg->host_bytes, (long long)n_host,
                         (long long)bb);
        goto fail;
    }
    t->job = calloc((size_t)t->q, sizeof *t->job);
    t->job_free = calloc((size_t)t->q, sizeof *t->job_free);
    t->qring = calloc((size_t)t->q, sizeof *t->qring);
    t->dring = calloc((size_t)t->q, sizeof *t->dring);
    if (!t->job || !t->job_free || !t->qring || !t->dring ||
        (disk && !(t->cio = malloc((size_t)slot_bytes)))) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for %d tier copy jobs", t->q);
        goto fail;
    }
    for (int32_t i = 0; i < t->q; i++)
        t->job_free[t->n_job_free++] = t->q - 1 - i;
    if (level_init(&t->lv[KVF_KV_TIER_HOST], KVF_KV_TIER_HOST, n_host, t->bs) != KVF_OK ||
        level_init(&t->lv[KVF_KV_TIER_DISK], KVF_KV_TIER_DISK, n_disk, t->bs) != KVF_OK ||
        !(t->stage = malloc((size_t)bb)) ||
        (disk && !(t->io = malloc((size_t)slot_bytes)))) {
        st = kvf_err_set(err, KVF_ERR_NOMEM, "kv: out of memory for a host tier of %lld blocks "
                         "of %lld bytes", (long long)n_host, (long long)bb);
        goto fail;
    }
    if (disk) {
        if (snprintf(t->path, sizeof t->path, "%s/%s", cfg->disk_dir, DISK_FILE) >=
            (int)sizeof t->path) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "kv: disk tier directory %s: path too long",
                             cfg->disk_dir);
            goto fail;
        }
        if ((st = disk_open(cfg->disk_dir, &t->dirfd, &t->fd, err)) != KVF_OK)
            goto fail;
        /* the file grows as slots are written: refuse a size the filesystem cannot hold now
         * (measured after the file was emptied, so a previous run's file counts as free) */
        struct statvfs vs;
        if (fstatvfs(t->fd, &vs) == 0 &&
            (uint64_t)n_disk * (uint64_t)slot_bytes >
                (uint64_t)vs.f_bavail * (uint64_t)vs.f_frsize) {
            st = kvf_err_set(err, KVF_ERR_INVALID, "kv: --kv-disk-bytes=%lld is more than the "
                             "free space of --kv-disk-dir=%s (%llu bytes)",
                             (long long)cfg->disk_bytes, cfg->disk_dir,
                             (unsigned long long)vs.f_bavail * (unsigned long long)vs.f_frsize);
            goto fail;
        }
    }
    t->st.tier[KVF_KV_TIER_HOST].capacity = n_host;
    t->st.tier[KVF_KV_TIER_DISK].capacity = n_disk;
    kvf_log(KVF_LOG_INFO, "kv: host tier of %lld blocks (%lld bytes)%s%s (%lld slots)",
            (long long)n_host, (long long)(n_host * bb), disk ? ", disk tier " : "",
            disk ? t->path : "", (long long)n_disk);
    *out = t;
    return KVF_OK;
fail:
    kvf_kv_tier_destroy(t);
    return st;
}

void kvf_kv_tier_destroy(kvf_kv_tier *t)
{
    if (!t)
        return;
    if (t->attached)
        kvf_kv_tier_detach(t);
    if (t->sync_made) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv_work);
        pthread_cond_destroy(&t->cv_done);
    }
    free(t->job);
    free(t->job_free);
    free(t->qring);
    free(t->dring);
    free(t->cio);
    if (t->fd >= 0) {
        close(t->fd);
        unlinkat(t->dirfd, DISK_FILE, 0); /* the directory we locked, wherever its path leads now */
    }
    if (t->dirfd >= 0)
        close(t->dirfd); /* drops the lock */
    level_fini(&t->lv[KVF_KV_TIER_HOST]);
    level_fini(&t->lv[KVF_KV_TIER_DISK]);
    free(t->host_mem);
    free(t->stage);
    free(t->io);
    free(t);
}

void kvf_kv_tier_get_stats(const kvf_kv_tier *t, kvf_kv_tier_stats *out)
{
    *out = t->st;
    out->tier[KVF_KV_TIER_HOST].used = t->lv[KVF_KV_TIER_HOST].n_used;
    out->tier[KVF_KV_TIER_DISK].used = t->lv[KVF_KV_TIER_DISK].n_used;
    out->tier[KVF_KV_TIER_HOST].in_flight = t->lv[KVF_KV_TIER_HOST].n_busy;
    out->tier[KVF_KV_TIER_DISK].in_flight = t->lv[KVF_KV_TIER_DISK].n_busy;
}

const char *kvf_kv_tier_disk_path(const kvf_kv_tier *t) { return t->path; }
int64_t kvf_kv_tier_disk_slot_bytes(const kvf_kv_tier *t) { return t->slot_bytes; }

int64_t kvf_kv_tier_slot_bytes_for(const kvf_kv_layout *layout)
{
    return (int64_t)sizeof(disk_hdr) + (int64_t)layout->block_size * (int64_t)sizeof(int32_t) +
           layout->block_bytes;
}

/* ---- what the pool calls ------------------------------------------------------------------- */

/* Unlinks a used slot from the LRU and the index, keeping it used (busy: a job holds it). */
static void level_pin(tier_level *l, int32_t id)
{
    tier_slot *s = &l->slot[id];
    level_unlink(l, id);
    s->busy = 1;
    l->n_busy++;
}

/* A busy slot goes back to the free stack. */
static void level_unpin_free(tier_level *l, int32_t id)
{
    tier_slot *s = &l->slot[id];
    s->busy = 0;
    s->used = 0;
    l->n_busy--;
    l->n_used--;
    level_push_free(l, id);
}

/* Moves one block from a busy slot into pool block `block`; false with why on a refused disk
 * read (*corrupt set) or a failed copy. Copy thread. */
static bool copy_one(kvf_kv_tier *t, const tier_job *j, bool *corrupt, char *why, size_t why_len)
{
    const char *src;
    if (j->tier == KVF_KV_TIER_HOST) {
        src = t->host_mem + (int64_t)j->slot * t->block_bytes;
    } else {
        const char *w = NULL;
        src = disk_read(t, t->cio, j->slot, j->hash, j->parent, &w);
        if (!src) {
            *corrupt = true;
            snprintf(why, why_len, "%s", w);
            return false;
        }
    }
    kvf_err err = {0};
    if (t->mem->from_host(t->mem_ctx, t->base, t->block_bytes, j->block, src, &err) != KVF_OK) {
        snprintf(why, why_len, "copy into the pool failed: %.160s", err.msg);
        return false;
    }
    return true;
}

static void *copy_main(void *arg)
{
    kvf_kv_tier *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->stop && t->qn == 0)
            pthread_cond_wait(&t->cv_work, &t->mu);
        if (t->qn == 0)
            break; /* stopping, and every queued job is done */
        int32_t id = t->qring[t->qh];
        t->qh = (t->qh + 1) % t->q;
        t->qn--;
        const tier_job *q = &t->job[id]; /* these fields do not change while queued */
        tier_job j = {.tier = q->tier, .slot = q->slot, .block = q->block, .hash = q->hash,
                      .parent = q->parent};
        pthread_mutex_unlock(&t->mu);
        if (t->cfg.copy_hook)
            t->cfg.copy_hook(t->cfg.hook_ctx, j.tier, j.block);
        bool corrupt = false;
        char why[sizeof j.why] = "";
        bool ok = copy_one(t, &j, &corrupt, why, sizeof why);
        int64_t t1 = kvf_now_ns();
        pthread_mutex_lock(&t->mu);
        tier_job *jp = &t->job[id];
        jp->state = ok ? JOB_DONE : JOB_FAILED;
        jp->corrupt = corrupt;
        jp->t1 = t1;
        memcpy(jp->why, why, sizeof why);
        t->dring[(t->dh + t->dn) % t->q] = id;
        t->dn++;
        pthread_cond_broadcast(&t->cv_done);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

kvf_status kvf_kv_tier_attach(kvf_kv_tier *t, const kvf_kv_layout *layout,
                              const kvf_kv_mem_ops *mem, void *mem_ctx, void *base,
                              kvf_kv_event_fn fn, void *ctx, kvf_err *err)
{
    if (t->attached)
        return kvf_err_set(err, KVF_ERR_STATE, "kv: the tiers already serve another pool");
    if (layout->block_bytes != t->block_bytes || layout->block_size != t->bs)
        return kvf_err_set(err, KVF_ERR_INVALID, "kv: tiers made for blocks of %lld bytes and %d "
                           "tokens cannot serve a pool of %lld bytes and %d tokens",
                           (long long)t->block_bytes, t->bs, (long long)layout->block_bytes,
                           layout->block_size);
    t->mem = mem;
    t->mem_ctx = mem_ctx;
    t->base = base;
    t->stop = false;
    t->qh = t->qn = t->dh = t->dn = 0;
    if (!t->cfg.synchronous && mem->from_host_any_thread) {
        int rc = pthread_create(&t->thread, NULL, copy_main, t);
        if (rc != 0)
            return kvf_err_set(err, KVF_ERR_NOMEM, "kv: tier: cannot start the copy thread: %s",
                               strerror(rc));
        t->thread_on = true;
    }
    t->attached = true;
    t->on_event = fn;
    t->event_ctx = ctx;
    kvf_log(KVF_LOG_DEBUG, "kv: tier promotions %s", t->thread_on ? "on a copy thread" :
            "synchronous");
    return KVF_OK;
}

void kvf_kv_tier_detach(kvf_kv_tier *t)
{
    if (t->thread_on) { /* the thread finishes every queued copy before it ends */
        pthread_mutex_lock(&t->mu);
        t->stop = true;
        pthread_cond_broadcast(&t->cv_work);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
        t->thread_on = false;
    }
    /* jobs never reaped: their slots go, silently (the pool is going away) */
    for (int32_t id = 0; id < t->q && t->n_jobs > 0; id++) {
        tier_job *j = &t->job[id];
        if (!j->live)
            continue;
        level_unpin_free(&t->lv[j->tier], j->slot);
        j->live = false;
        j->state = JOB_FREE;
        t->job_free[t->n_job_free++] = id;
        t->n_jobs--;
    }
    t->dn = t->qn = 0;
    t->attached = false;
    t->on_event = NULL;
}

bool kvf_kv_tier_async(const kvf_kv_tier *t) { return t->thread_on; }

int32_t kvf_kv_tier_jobs(const kvf_kv_tier *t) { return t->n_jobs; }

int32_t kvf_kv_tier_job_begin(kvf_kv_tier *t, kvf_kv_tier_ref r)
{
    if (!t->thread_on || t->n_job_free == 0)
        return -1;
    int32_t id = t->job_free[--t->n_job_free];
    tier_level *l = &t->lv[r.tier];
    const tier_slot *s = &l->slot[r.slot];
    t->job[id] = (tier_job){.live = true, .state = JOB_BEGUN, .tier = r.tier, .slot = r.slot,
                            .block = -1, .hash = s->hash, .parent = s->parent};
    level_pin(l, r.slot);
    t->n_jobs++;
    return id;
}

void kvf_kv_tier_job_submit(kvf_kv_tier *t, int32_t id, int32_t block)
{
    /* the clock starts here, once the pool block was taken: the promotion time the router is
     * told (on_promote) holds no other block's eviction or demotion made to free it */
    int64_t t0 = kvf_now_ns();
    pthread_mutex_lock(&t->mu);
    t->job[id].t0 = t0;
    t->job[id].block = block;
    t->job[id].state = JOB_QUEUED;
    t->qring[(t->qh + t->qn) % t->q] = id;
    t->qn++;
    pthread_cond_signal(&t->cv_work);
    pthread_mutex_unlock(&t->mu);
}

void kvf_kv_tier_job_abort(kvf_kv_tier *t, int32_t id)
{
    tier_job *j = &t->job[id];
    tier_level *l = &t->lv[j->tier];
    tier_slot *s = &l->slot[j->slot];
    /* back at the LRU tail (stamps never go back) and into the index */
    s->busy = 0;
    l->n_busy--;
    l->n_used--;
    if (l->tail >= 0 && l->slot[l->tail].stamp > s->stamp)
        s->stamp = l->slot[l->tail].stamp;
    s->used = 1;
    s->prev = l->tail;
    s->next = -1;
    if (l->tail >= 0)
        l->slot[l->tail].next = j->slot;
    else
        l->head = j->slot;
    l->tail = j->slot;
    l->n_used++;
    map_insert(l, j->slot);
    j->live = false;
    j->state = JOB_FREE;
    t->job_free[t->n_job_free++] = id;
    t->n_jobs--;
}

bool kvf_kv_tier_reap(kvf_kv_tier *t, kvf_kv_tier_done *out)
{
    if (t->n_jobs == 0)
        return false;
    pthread_mutex_lock(&t->mu);
    if (t->dn == 0) {
        pthread_mutex_unlock(&t->mu);
        return false;
    }
    int32_t id = t->dring[t->dh];
    t->dh = (t->dh + 1) % t->q;
    t->dn--;
    tier_job j = t->job[id];
    t->job[id].state = JOB_FREE;
    pthread_mutex_unlock(&t->mu);
    tier_level *l = &t->lv[j.tier];
    bool ok = j.state == JOB_DONE;
    if (ok) {
        t->st.tier[j.tier].promoted++;
        t->st.tier[j.tier].bytes_promoted += t->block_bytes;
        double sec = (double)(j.t1 - j.t0) / 1e9;
        if (t->cfg.on_promote)
            t->cfg.on_promote(t->cfg.promote_ctx, j.tier, sec < 0 ? 0 : sec);
    } else {
        kvf_log(KVF_LOG_WARN, "kv: %s tier%s%s: slot %d (block %016llx) not promoted: %s (a miss)",
                j.tier == KVF_KV_TIER_DISK ? "disk" : "host", j.tier == KVF_KV_TIER_DISK ? " " : "",
                j.tier == KVF_KV_TIER_DISK ? t->path : "", j.slot, (unsigned long long)j.hash,
                j.why);
        if (j.corrupt)
            t->st.tier[j.tier].corrupt++;
        if (!j.stale) { /* gone from every tier */
            emit(t, KVF_KV_EVENT_REMOVED, l, j.slot);
            t->st.tier[j.tier].dropped++;
        }
    }
    level_unpin_free(l, j.slot);
    t->job[id].live = false;
    t->job_free[t->n_job_free++] = id;
    t->n_jobs--;
    *out = (kvf_kv_tier_done){.block = j.block, .ok = ok, .stale = j.stale};
    return true;
}

void kvf_kv_tier_wait(kvf_kv_tier *t, int64_t timeout_ns)
{
    if (t->n_jobs == 0 || timeout_ns <= 0)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_nsec + timeout_ns;
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    pthread_mutex_lock(&t->mu);
    while (t->dn == 0 && pthread_cond_timedwait(&t->cv_done, &t->mu, &ts) == 0) {
    }
    pthread_mutex_unlock(&t->mu);
}

/* A job in flight for hash: the hash now lives elsewhere (the pool computed it, or it came down
 * again), so the job's block must not be registered and its end raises no event. */
static void jobs_mark_stale(kvf_kv_tier *t, uint64_t hash)
{
    for (int32_t id = 0; id < t->q && t->n_jobs > 0; id++)
        if (t->job[id].live && t->job[id].hash == hash)
            t->job[id].stale = true;
}

/* Moves the host tier's LRU victim down to disk (STORED, tier DISK), dropping disk's own LRU
 * victim first when disk is full; without disk (or when the write fails) it is dropped. */
static void host_evict_one(kvf_kv_tier *t)
{
    tier_level *host = &t->lv[KVF_KV_TIER_HOST], *disk = &t->lv[KVF_KV_TIER_DISK];
    int32_t hs = host->head;
    if (disk->n == 0 || (!level_has_free(disk) && disk->head < 0)) { /* (every slot busy) */
        level_drop(t, host, hs);
        return;
    }
    if (!level_has_free(disk))
        level_drop(t, disk, disk->head);
    int32_t ds = level_take_free(disk);
    if (!disk_write(t, hs, ds)) {
        level_push_free(disk, ds);
        level_drop(t, host, hs);
        return;
    }
    const tier_slot *s = &host->slot[hs];
    level_use(disk, ds, s->hash, s->parent, host->tokens + (int64_t)hs * t->bs, t->bs, s->stamp);
    level_release(host, hs);
    t->st.tier[KVF_KV_TIER_DISK].demoted++;
    t->st.tier[KVF_KV_TIER_DISK].bytes_demoted += t->block_bytes;
    emit(t, KVF_KV_EVENT_STORED, disk, ds);
}

void *kvf_kv_tier_put_begin(kvf_kv_tier *t, int32_t *slot_out)
{
    tier_level *host = &t->lv[KVF_KV_TIER_HOST];
    if (!level_has_free(host) && host->head < 0)
        return NULL; /* every host slot is busy with a promotion */
    if (!level_has_free(host))
        host_evict_one(t);
    int32_t id = level_take_free(host);
    *slot_out = id;
    return t->host_mem + (int64_t)id * t->block_bytes;
}

void kvf_kv_tier_put_commit(kvf_kv_tier *t, int32_t slot, uint64_t hash, uint64_t parent,
                            const int32_t *tokens, int64_t now)
{
    tier_level *host = &t->lv[KVF_KV_TIER_HOST];
    /* a disk copy is older than the pool's: the hash stays in one place */
    int32_t old = map_find(&t->lv[KVF_KV_TIER_DISK], hash);
    if (old >= 0)
        level_release(&t->lv[KVF_KV_TIER_DISK], old);
    if (t->n_jobs > 0)
        jobs_mark_stale(t, hash);
    /* stamps never go back (the LRU check), even with a clock that does */
    if (host->tail >= 0 && host->slot[host->tail].stamp > now)
        now = host->slot[host->tail].stamp;
    level_use(host, slot, hash, parent, tokens, t->bs, now);
    t->st.tier[KVF_KV_TIER_HOST].demoted++;
    t->st.tier[KVF_KV_TIER_HOST].bytes_demoted += t->block_bytes;
    emit(t, KVF_KV_EVENT_STORED, host, slot);
}

void kvf_kv_tier_put_abort(kvf_kv_tier *t, int32_t slot)
{
    level_push_free(&t->lv[KVF_KV_TIER_HOST], slot);
}

bool kvf_kv_tier_find(kvf_kv_tier *t, uint64_t hash, uint64_t parent, const int32_t *tokens,
                      bool count, kvf_kv_tier_ref *out)
{
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        tier_level *l = &t->lv[k];
        int32_t id = map_find(l, hash);
        if (id < 0)
            continue;
        if (l->slot[id].parent != parent ||
            memcmp(l->tokens + (int64_t)id * t->bs, tokens, (size_t)t->bs * sizeof *tokens) != 0) {
            t->st.tier[k].mismatches++;
            return false; /* a hash lives in one tier only: no other copy to find */
        }
        if (count)
            t->st.tier[k].hits++;
        *out = (kvf_kv_tier_ref){.tier = (kvf_kv_tier_kind)k, .slot = id};
        return true;
    }
    return false;
}

const void *kvf_kv_tier_take(kvf_kv_tier *t, kvf_kv_tier_ref r, int64_t *t0_out)
{
    *t0_out = kvf_now_ns();
    tier_level *l = &t->lv[r.tier];
    if (r.tier == KVF_KV_TIER_HOST) {
        memcpy(t->stage, t->host_mem + (int64_t)r.slot * t->block_bytes, (size_t)t->block_bytes);
    } else {
        const char *why = NULL;
        const char *bytes = disk_read(t, t->io, r.slot, l->slot[r.slot].hash,
                                      l->slot[r.slot].parent, &why);
        if (!bytes) {
            kvf_log(KVF_LOG_WARN, "kv: disk tier %s: slot %d (block %016llx) refused: %s (a miss)",
                    t->path, r.slot, (unsigned long long)l->slot[r.slot].hash, why);
            t->st.tier[r.tier].corrupt++;
            level_drop(t, l, r.slot);
            return NULL;
        }
        memcpy(t->stage, bytes, (size_t)t->block_bytes);
    }
    level_release(l, r.slot);
    return t->stage;
}

void kvf_kv_tier_promoted(kvf_kv_tier *t, kvf_kv_tier_kind tier, int64_t t0)
{
    double s = (double)(kvf_now_ns() - t0) / 1e9;
    t->st.tier[tier].promoted++;
    t->st.tier[tier].bytes_promoted += t->block_bytes;
    if (t->cfg.on_promote)
        t->cfg.on_promote(t->cfg.promote_ctx, tier, s < 0 ? 0 : s);
}

void kvf_kv_tier_forget(kvf_kv_tier *t, uint64_t hash)
{
    if (t->n_jobs > 0)
        jobs_mark_stale(t, hash);
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        int32_t id = map_find(&t->lv[k], hash);
        if (id >= 0)
            level_release(&t->lv[k], id);
    }
}

void kvf_kv_tier_clear(kvf_kv_tier *t, int32_t *n_out)
{
    int32_t n = 0;
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++)
        while (t->lv[k].head >= 0) {
            level_drop(t, &t->lv[k], t->lv[k].head);
            n++;
        }
    /* blocks a promotion is copying up go too: their jobs finish, but nothing is registered */
    for (int32_t id = 0; id < t->q && t->n_jobs > 0; id++) {
        tier_job *j = &t->job[id];
        if (!j->live || j->stale)
            continue;
        emit(t, KVF_KV_EVENT_REMOVED, &t->lv[j->tier], j->slot);
        t->st.tier[j->tier].dropped++;
        j->stale = true;
        n++;
    }
    if (n_out)
        *n_out = n;
}

int32_t kvf_kv_tier_snapshot(const kvf_kv_tier *t, kvf_kv_event_fn fn, void *ctx)
{
    int32_t n = 0;
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        const tier_level *l = &t->lv[k];
        for (int32_t id = l->head; id >= 0; id = l->slot[id].next) {
            const tier_slot *s = &l->slot[id];
            kvf_kv_event ev = {.type = KVF_KV_EVENT_STORED, .hash = s->hash,
                               .parent_hash = s->parent, .block = -1,
                               .tokens = l->tokens + (int64_t)id * t->bs, .n_tokens = t->bs,
                               .tier = k};
            if (fn)
                fn(ctx, &ev);
            n++;
        }
        /* slots a promotion is copying up: still here until it completes */
        for (int32_t id = 0; id < t->q && t->n_jobs > 0; id++) {
            const tier_job *j = &t->job[id];
            if (!j->live || j->stale || (int)j->tier != k)
                continue;
            kvf_kv_event ev = {.type = KVF_KV_EVENT_STORED, .hash = j->hash,
                               .parent_hash = j->parent, .block = -1,
                               .tokens = l->tokens + (int64_t)j->slot * t->bs, .n_tokens = t->bs,
                               .tier = k};
            if (fn)
                fn(ctx, &ev);
            n++;
        }
    }
    return n;
}

kvf_status kvf_kv_tier_check(const kvf_kv_tier *t, bool (*pool_has)(const void *ctx, uint64_t h),
                             const void *pool_ctx, kvf_err *err)
{
    static const char *names[] = {"pool", "host", "disk"};
    for (int k = KVF_KV_TIER_HOST; k <= KVF_KV_TIER_DISK; k++) {
        const tier_level *l = &t->lv[k];
        const char *nm = names[k];
        /* the LRU: used slots only, linked both ways, oldest first, each found in the index */
        int32_t walked = 0, prev = -1;
        for (int32_t id = l->head; id >= 0; prev = id, id = l->slot[id].next) {
            const tier_slot *s = &l->slot[id];
            if (++walked > l->n)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: the %s tier's LRU loops",
                                   nm);
            if (!s->used || s->busy || s->prev != prev || s->free_pos >= 0)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier LRU entry %d "
                                   "(slot %d, used %d, prev %d expected %d, free_pos %d) is not a "
                                   "used slot", nm, walked - 1, id, s->used, s->prev, prev,
                                   s->free_pos);
            if (prev >= 0 && l->slot[prev].stamp > s->stamp)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier LRU out of order "
                                   "at slot %d (%lld after %lld)", nm, id, (long long)s->stamp,
                                   (long long)l->slot[prev].stamp);
            if (map_find(l, s->hash) != id)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier slot %d holds "
                                   "%016llx but the index does not find it there", nm, id,
                                   (unsigned long long)s->hash);
            int other = k == KVF_KV_TIER_HOST ? KVF_KV_TIER_DISK : KVF_KV_TIER_HOST;
            if (map_find(&t->lv[other], s->hash) >= 0)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: block %016llx is in both "
                                   "the host and the disk tier", (unsigned long long)s->hash);
            if (pool_has && pool_has(pool_ctx, s->hash))
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: block %016llx is in both "
                                   "the pool and the %s tier", (unsigned long long)s->hash, nm);
        }
        if (prev != l->tail)
            return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier LRU tail is %d but "
                               "the walk ends at %d", nm, l->tail, prev);
        /* counts: used + free == slots; the index holds exactly the used slots */
        int32_t n_idx = 0, n_used = 0, n_busy = 0;
        for (uint64_t i = 0; l->n > 0 && i <= l->mask; i++)
            if (l->map[i] > 0) {
                n_idx++;
                if (l->map[i] > l->n || !l->slot[l->map[i] - 1].used)
                    return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier index "
                                       "entry %llu points at slot %d, which is not used", nm,
                                       (unsigned long long)i, l->map[i] - 1);
            }
        if (l->n_fresh < 0 || l->n_fresh > l->n)
            return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier has %d slots used "
                               "at some time, of %d", nm, l->n_fresh, l->n);
        for (int32_t id = 0; id < l->n; id++) {
            const tier_slot *s = &l->slot[id];
            if (id >= l->n_fresh) { /* never used: free, not on the stack */
                if (s->used || s->busy)
                    return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier slot %d "
                                       "was never handed out but is used", nm, id);
                continue;
            }
            n_used += s->used;
            if (s->busy) {
                n_busy++;
                if (!s->used || s->prev >= 0 || s->next >= 0 || l->tail == id ||
                    l->head == id || map_find(l, s->hash) == id)
                    return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier slot %d is "
                                       "busy (a promotion copies it) but is %s", nm, id,
                                       !s->used ? "not used" : map_find(l, s->hash) == id ?
                                       "in the index" : "on the LRU");
            }
            bool on_free = s->free_pos >= 0 && s->free_pos < l->n_free &&
                           l->free_stack[s->free_pos] == id;
            /* a slot between put_begin and commit is neither: none is, between pool calls */
            if (on_free == (bool)s->used)
                return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier slot %d is %s "
                                   "and %son the free stack", nm, id, s->used ? "used" : "unused",
                                   on_free ? "" : "not ");
        }
        if (walked + n_busy != n_used || n_used != l->n_used || n_idx != walked ||
            n_busy != l->n_busy || n_used + l->n_free != l->n_fresh)
            return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %s tier counts disagree: "
                               "used %d/%d (counted/kept), busy %d/%d, LRU walk %d, index %d, "
                               "free %d, slots %d (%d ever used)", nm, n_used, l->n_used, n_busy,
                               l->n_busy, walked, n_idx, l->n_free, l->n, l->n_fresh);
    }
    /* jobs: one per busy slot; a live (not stale) one's hash is nowhere else */
    int32_t n_jobs = 0;
    for (int32_t id = 0; id < t->q; id++) {
        const tier_job *j = &t->job[id];
        if (!j->live)
            continue;
        n_jobs++;
        const tier_level *l = &t->lv[j->tier];
        if (j->slot < 0 || j->slot >= l->n || !l->slot[j->slot].busy ||
            l->slot[j->slot].hash != j->hash)
            return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: promotion job %d holds %s "
                               "tier slot %d, which is not busy with its block %016llx", id,
                               names[j->tier], j->slot, (unsigned long long)j->hash);
        if (!j->stale && (map_find(&t->lv[KVF_KV_TIER_HOST], j->hash) >= 0 ||
                          map_find(&t->lv[KVF_KV_TIER_DISK], j->hash) >= 0 ||
                          (pool_has && pool_has(pool_ctx, j->hash))))
            return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: block %016llx is being "
                               "promoted from the %s tier but is also held elsewhere",
                               (unsigned long long)j->hash, names[j->tier]);
    }
    if (n_jobs != t->n_jobs || n_jobs != t->lv[KVF_KV_TIER_HOST].n_busy +
                                            t->lv[KVF_KV_TIER_DISK].n_busy ||
        n_jobs + t->n_job_free != t->q)
        return kvf_err_set(err, KVF_ERR_INTERNAL, "kv: invariant: %d promotion jobs counted, %d "
                           "kept, %d busy slots, %d free of %d", n_jobs, t->n_jobs,
                           t->lv[KVF_KV_TIER_HOST].n_busy + t->lv[KVF_KV_TIER_DISK].n_busy,
                           t->n_job_free, t->q);
    return KVF_OK;
}
