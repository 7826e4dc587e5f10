/*
 * Lifecycle simulation of a radix-caching server on a pool (see lifecycle_sim.h).
 *
 * Every pool call goes through a wrapper that updates the shadow model and
 * compares the pool's counters with it; every tick ends with a full
 * comparison of slot ownership (pool, shadow, and the scheduler's own
 * references, so a slot nobody refers to is a leak the moment it happens).
 * State contents are modelled by tags: the state of a request after p tokens
 * is the tag (key, p), key naming the prefix (a system prompt, or one
 * conversation), written at both ends of the page. Every copy, track, hit
 * and insert checks the tag it expects.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "pool/internal.h"
#include "tests/harness/lifecycle_sim.h"

enum { RQ_FREE, RQ_WAITING, RQ_PREFILL, RQ_DECODE, RQ_DONE };
enum { OWN_FREE = 0, OWN_WORK, OWN_TRACK, OWN_NODE };

static const char *const own_names[] = { "free", "a working slot", "a track slot", "a cache node" };

#define SYS_KEY_BIT (1ull << 63)
/* Conversations longer than this start over (keeps prompts bounded). */
#define MAX_CONV_TOKENS 32768
/* Requests in flight (waiting + running) at most, per running slot. */
#define INFLIGHT_PER_RUNNING 3
/* Conversation records per running slot: idle ones can be continued. */
#define CONVS_PER_RUNNING 8
/* A run that has not finished after this many ticks per request is stuck. */
#define TICKS_PER_REQUEST_LIMIT 1000

struct req {
    int state;
    int conv;
    uint64_t conv_key;
    int sys;
    int64_t prompt, total, pos;
    int64_t abort_at;
    int32_t work;
    int32_t track[2];
    int next_track;
    int64_t last_track; /* tokens of the last tracked state, 0 = none */
    int last_track_idx;
    int cow_node; /* node whose state is copied in at the first forward, -1 none */
};

struct conv {
    uint64_t key;
    int sys;
    int64_t len;
    int busy;
};

struct node {
    int live;
    uint64_t key;
    int64_t len;
    int32_t slot;
    int lock;
    int64_t used;
};

struct tag {
    uint64_t key, len, check;
};

struct sim {
    const struct stepq__sim_config *cfg;
    struct stepq__sim_stats *st;
    stepq_pool_t *pool;
    int32_t cap;
    uint64_t page_bytes;
    int per_req;
    int tracking;
    uint64_t rng;
    char *err;
    size_t errlen;
    int failed, status, closing, finished;

    struct req *reqs;
    int n_reqs, live;
    int *free_reqs, n_free_reqs;
    int *waitq, wq_head, wq_len;
    int *running, n_running;
    int *done, n_done;
    struct conv *convs;
    int n_convs;
    uint64_t next_conv_key;
    int64_t *sys_len;
    struct node *nodes;

    uint8_t *own, *expect;
    int32_t *ids; /* cap + 1 entries: room for any alloc the injection makes */
    int32_t sh_in_use, sh_hw;
    uint64_t sh_alloc, sh_free;
    int64_t issued, tick_limit;

    uv_timer_t t_arrive, t_prefill, t_decode, t_complete;
};

/* --- helpers ---------------------------------------------------------------- */

static uint64_t rnd(struct sim *s)
{
    uint64_t z = (s->rng += 0x9e3779b97f4a7c15ull); /* splitmix64 */

    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int64_t rnd_range(struct sim *s, int64_t lo, int64_t hi)
{
    return lo + (int64_t)(rnd(s) % (uint64_t)(hi - lo + 1));
}

static double rnd_unit(struct sim *s)
{
    return (double)(rnd(s) >> 11) * 0x1p-53;
}

static int fail(struct sim *s, int status, const char *fmt, ...)
{
    if (!s->failed) {
        va_list ap;
        int n = snprintf(s->err, s->errlen, "tick %" PRId64 ": ", s->st->ticks);

        va_start(ap, fmt);
        if (n >= 0 && (size_t)n < s->errlen)
            vsnprintf(s->err + n, s->errlen - (size_t)n, fmt, ap);
        va_end(ap);
        s->failed = 1;
        s->status = status;
    }
    return status;
}

static int64_t next_mult(int64_t x, int64_t m)
{
    return (x / m + 1) * m;
}

static uint64_t state_key(const struct sim *s, const struct req *r, int64_t p)
{
    return p <= s->sys_len[r->sys] ? (SYS_KEY_BIT | (uint64_t)r->sys) : r->conv_key;
}

/* --- page tags ---------------------------------------------------------------- */

static uint64_t tag_check(uint64_t key, uint64_t len)
{
    return (key * 0x9e3779b97f4a7c15ull) ^ (len * 0xc2b2ae3d27d4eb4full) ^ 0x5851f42d4c957f2dull;
}

static uint8_t *page_of(struct sim *s, int32_t slot)
{
    void *p = NULL;
    int ret = stepq_pool_page(s->pool, slot, &p);

    if (ret < 0) {
        fail(s, ret, "stepq_pool_page(%" PRId32 "): %s", slot, stepq_last_error());
        return NULL;
    }
    return p;
}

static void tag_write(struct sim *s, int32_t slot, uint64_t key, int64_t len)
{
    struct tag t = { key, (uint64_t)len, tag_check(key, (uint64_t)len) };
    uint8_t *p = page_of(s, slot);

    if (!p)
        return;
    memcpy(p, &t, sizeof(t));
    memcpy(p + s->page_bytes - sizeof(t), &t, sizeof(t));
}

static int tag_read(struct sim *s, int32_t slot, struct tag *t)
{
    struct tag tail;
    uint8_t *p = page_of(s, slot);

    if (!p)
        return -1;
    memcpy(t, p, sizeof(*t));
    memcpy(&tail, p + s->page_bytes - sizeof(tail), sizeof(tail));
    if (memcmp(t, &tail, sizeof(tail)))
        return fail(s, STEPQ_EINTERNAL, "slot %" PRId32 ": page head and tail disagree (torn copy)",
                    slot);
    return 0;
}

/* Expects the state (key, len) in slot; len 0 means a cleared page. */
static int tag_expect(struct sim *s, int32_t slot, uint64_t key, int64_t len, const char *what)
{
    struct tag t, want = { 0, 0, 0 };

    if (len > 0)
        want = (struct tag){ key, (uint64_t)len, tag_check(key, (uint64_t)len) };
    if (tag_read(s, slot, &t) < 0)
        return -1;
    if (memcmp(&t, &want, sizeof(t)))
        return fail(s, STEPQ_EINTERNAL,
                    "%s: slot %" PRId32 " holds state (key %#" PRIx64 ", %" PRIu64
                    " tokens), expected (key %#" PRIx64 ", %" PRId64 " tokens)",
                    what, slot, t.key, t.len, key, len);
    return 0;
}

/* --- shadow-checked pool calls ------------------------------------------------ */

static int check_counters(struct sim *s, const char *after)
{
    stepq_pool_stats ps;
    int ret = stepq_pool_get_stats(s->pool, &ps, sizeof(ps));

    if (ret < 0)
        return fail(s, ret, "stats after %s: %s", after, stepq_last_error());
    if (ps.capacity != s->cap || ps.in_use != s->sh_in_use ||
        ps.available != s->cap - s->sh_in_use || ps.high_water != s->sh_hw ||
        ps.n_alloc != s->sh_alloc || ps.n_free != s->sh_free ||
        ps.in_use_bytes != (uint64_t)s->sh_in_use * s->page_bytes)
        return fail(s, STEPQ_EINTERNAL,
                    "after %s: pool counts in_use %" PRId32 ", available %" PRId32
                    ", high water %" PRId32 ", allocs %" PRIu64 ", frees %" PRIu64
                    "; the shadow model %" PRId32 ", %" PRId32 ", %" PRId32 ", %" PRIu64
                    ", %" PRIu64,
                    after, ps.in_use, ps.available, ps.high_water, ps.n_alloc, ps.n_free,
                    s->sh_in_use, s->cap - s->sh_in_use, s->sh_hw, s->sh_alloc, s->sh_free);
    return 0;
}

static int sim_alloc(struct sim *s, int32_t n, int32_t *ids, int kind)
{
    int ret = stepq_pool_alloc(s->pool, n, ids);

    s->st->pool_ops++;
    if (ret == STEPQ_ENOSPC) {
        if (s->cap - s->sh_in_use >= n)
            return fail(s, STEPQ_EINTERNAL,
                        "alloc(%" PRId32 ") failed with %" PRId32 " slots free in the shadow", n,
                        s->cap - s->sh_in_use);
        return check_counters(s, "a refused alloc") < 0 ? -1 : STEPQ_ENOSPC;
    }
    if (ret < 0)
        return fail(s, ret, "alloc(%" PRId32 "): %s", n, stepq_last_error());
    for (int32_t i = 0; i < n; i++) {
        int32_t id = ids[i];

        if (id < 1 || id > s->cap)
            return fail(s, STEPQ_EINTERNAL, "alloc issued slot %" PRId32 " (valid: 1..%" PRId32 ")",
                        id, s->cap);
        if (s->own[id] != OWN_FREE)
            return fail(s, STEPQ_EINTERNAL, "alloc issued slot %" PRId32 ", still held as %s", id,
                        own_names[s->own[id]]);
        s->own[id] = (uint8_t)kind;
    }
    s->sh_in_use += n;
    s->sh_alloc += (uint64_t)n;
    if (s->sh_in_use > s->sh_hw)
        s->sh_hw = s->sh_in_use;
    return check_counters(s, "alloc");
}

/* Frees a list that may contain -1 padding. */
static int sim_free(struct sim *s, const int32_t *ids, int32_t n)
{
    int32_t m = 0;
    int ret;

    for (int32_t i = 0; i < n; i++) {
        if (ids[i] == STEPQ_POOL_SLOT_PAD)
            continue;
        if (s->own[ids[i]] == OWN_FREE)
            return fail(s, STEPQ_EINTERNAL, "the scheduler frees slot %" PRId32 " twice", ids[i]);
        m++;
    }
    ret = stepq_pool_free(s->pool, ids, n);
    s->st->pool_ops++;
    if (ret < 0)
        return fail(s, ret, "free: %s", stepq_last_error());
    for (int32_t i = 0; i < n; i++)
        if (ids[i] != STEPQ_POOL_SLOT_PAD)
            s->own[ids[i]] = OWN_FREE;
    s->sh_in_use -= m;
    s->sh_free += (uint64_t)m;
    return check_counters(s, "free");
}

/* Copies one state and checks that the destination now holds the source's. */
static int sim_copy(struct sim *s, int32_t src, int32_t dst, const char *what)
{
    struct tag before;
    int ret;

    if (tag_read(s, src, &before) < 0)
        return -1;
    ret = stepq_pool_copy(s->pool, &src, &dst, 1);
    s->st->pool_ops++;
    if (ret < 0)
        return fail(s, ret, "%s: copy %" PRId32 " -> %" PRId32 ": %s", what, src, dst,
                    stepq_last_error());
    if (tag_expect(s, src, before.key, (int64_t)before.len, what) < 0 ||
        tag_expect(s, dst, before.key, (int64_t)before.len, what) < 0)
        return -1;
    return 0;
}

static int sim_clear(struct sim *s, int32_t slot)
{
    int ret = stepq_pool_clear(s->pool, &slot, 1);

    s->st->pool_ops++;
    if (ret < 0)
        return fail(s, ret, "clear %" PRId32 ": %s", slot, stepq_last_error());
    return tag_expect(s, slot, 0, 0, "clear");
}

/* --- the radix cache ---------------------------------------------------------- */

static int node_find(struct sim *s, uint64_t key, int64_t len)
{
    for (int32_t i = 0; i < s->cap; i++)
        if (s->nodes[i].live && s->nodes[i].key == key && s->nodes[i].len == len)
            return i;
    return -1;
}

/* Deepest cached state on the request's prefix that leaves a token to compute. */
static int node_match(struct sim *s, const struct req *r)
{
    uint64_t sys_key = SYS_KEY_BIT | (uint64_t)r->sys;
    int best = -1;

    for (int32_t i = 0; i < s->cap; i++) {
        const struct node *n = &s->nodes[i];

        if (!n->live || n->len >= r->prompt)
            continue;
        if (n->key != r->conv_key && !(n->key == sys_key && n->len <= s->sys_len[r->sys]))
            continue;
        if (best < 0 || n->len > s->nodes[best].len)
            best = i;
    }
    return best;
}

static int node_insert(struct sim *s, uint64_t key, int64_t len, int32_t slot)
{
    for (int32_t i = 0; i < s->cap; i++) {
        struct node *n = &s->nodes[i];

        if (n->live)
            continue;
        *n = (struct node){ 1, key, len, slot, 0, s->st->ticks };
        s->own[slot] = OWN_NODE;
        s->st->inserts++;
        return 0;
    }
    return fail(s, STEPQ_EINTERNAL, "more cache nodes than slots");
}

/* Evicts the least recently used unlocked node; 0 when none is evictable. */
static int evict_one(struct sim *s)
{
    int best = -1;

    for (int32_t i = 0; i < s->cap; i++) {
        const struct node *n = &s->nodes[i];

        if (n->live && n->lock == 0 && (best < 0 || n->used < s->nodes[best].used))
            best = i;
    }
    if (best < 0)
        return 0;
    if (sim_free(s, &s->nodes[best].slot, 1) < 0)
        return -1;
    s->nodes[best].live = 0;
    s->st->evictions++;
    return 1;
}

/* Allocates n slots, evicting cache nodes while the pool is short. */
static int alloc_evicting(struct sim *s, int32_t n, int32_t *ids, int kind)
{
    while (s->cap - s->sh_in_use < n) {
        int e = evict_one(s);

        if (e < 0)
            return -1;
        if (e == 0)
            break;
    }
    /* When still short this call must fail with ENOSPC and change nothing. */
    return sim_alloc(s, n, ids, kind);
}

/* --- requests --------------------------------------------------------------- */

static void running_remove(struct sim *s, int k)
{
    s->running[k] = s->running[--s->n_running];
}

static void req_release(struct sim *s, int idx)
{
    struct req *r = &s->reqs[idx];

    s->convs[r->conv].busy = 0;
    r->state = RQ_FREE;
    s->free_reqs[s->n_free_reqs++] = idx;
    s->live--;
}

/* Moves the working state to p tokens, checking it was intact at r->pos. */
static int advance(struct sim *s, struct req *r, int64_t p)
{
    if (tag_expect(s, r->work, state_key(s, r, r->pos), r->pos, "working state") < 0)
        return -1;
    tag_write(s, r->work, state_key(s, r, p), p);
    r->pos = p;
    return s->failed ? -1 : 0;
}

static int track(struct sim *s, struct req *r)
{
    int i;

    if (s->cfg->policy == STEPQ_POOL_POLICY_LAZY) {
        if (r->track[0] == STEPQ_POOL_SLOT_PAD) {
            int ret = alloc_evicting(s, 1, &r->track[0], OWN_TRACK);

            if (ret == STEPQ_ENOSPC) {
                s->st->track_skips++;
                return 0;
            }
            if (ret < 0)
                return -1;
        }
        i = 0;
    } else {
        i = r->next_track;
        r->next_track ^= 1;
    }
    if (sim_copy(s, r->work, r->track[i], "ping-pong track") < 0)
        return -1;
    r->last_track = r->pos;
    r->last_track_idx = i;
    s->st->track_copies++;
    return 0;
}

/* Cache of an unfinished request: fork the shared system-prompt state. */
static int fork_prefix(struct sim *s, struct req *r)
{
    uint64_t key = state_key(s, r, r->pos);
    int32_t slot;
    int ret;

    if (node_find(s, key, r->pos) >= 0)
        return 0;
    ret = alloc_evicting(s, 1, &slot, OWN_NODE);
    if (ret == STEPQ_ENOSPC)
        return 0;
    if (ret < 0 || sim_copy(s, r->work, slot, "prefix fork") < 0)
        return -1;
    s->st->forks++;
    return node_insert(s, key, r->pos, slot);
}

static int admit(struct sim *s)
{
    while (s->wq_len > 0 && s->n_running < s->cfg->max_running) {
        int idx = s->waitq[s->wq_head];
        struct req *r = &s->reqs[idx];
        int32_t ids[3] = { -1, -1, -1 };
        int node = s->cfg->policy == STEPQ_POOL_POLICY_NO_CACHE ? -1 : node_match(s, r);
        int ret;

        if (node >= 0)
            s->nodes[node].lock++; /* so the eviction below cannot take it */
        ret = alloc_evicting(s, s->per_req, ids, OWN_WORK);
        if (ret == STEPQ_ENOSPC) {
            if (node >= 0)
                s->nodes[node].lock--;
            s->st->admission_waits++;
            if (s->n_running == 0)
                return fail(s, STEPQ_EINTERNAL,
                            "nothing runs and a request needing %d slots cannot be admitted "
                            "(pool of %" PRId32 ")",
                            s->per_req, s->cap);
            return 0;
        }
        if (ret < 0)
            return -1;
        for (int i = 1; i < s->per_req; i++)
            s->own[ids[i]] = OWN_TRACK;
        r->work = ids[0];
        r->track[0] = ids[1];
        r->track[1] = ids[2];
        r->next_track = 0;
        r->last_track = 0;
        if (node >= 0) {
            r->cow_node = node;
            r->pos = s->nodes[node].len;
            s->nodes[node].used = s->st->ticks;
            s->st->prefix_hits++;
        } else {
            r->cow_node = -1;
            r->pos = 0;
            if (sim_clear(s, r->work) < 0)
                return -1;
            s->st->prefix_misses++;
        }
        r->state = RQ_PREFILL;
        s->wq_head = (s->wq_head + 1) % s->n_reqs;
        s->wq_len--;
        s->running[s->n_running++] = idx;
    }
    return 0;
}

static void new_request(struct sim *s)
{
    const struct stepq__sim_config *c = s->cfg;
    int idx = s->free_reqs[--s->n_free_reqs];
    struct req *r = &s->reqs[idx];
    int ci = (int)rnd_range(s, 0, s->n_convs - 1);
    struct conv *cv = &s->convs[ci];

    if (cv->busy || cv->len <= s->sys_len[cv->sys] || cv->len > MAX_CONV_TOKENS ||
        rnd_unit(s) >= c->follow_rate) {
        /* A new conversation, in an idle record (busy ones <= live < n_convs). */
        while (s->convs[ci].busy)
            ci = (ci + 1) % s->n_convs;
        cv = &s->convs[ci];
        cv->key = s->next_conv_key++;
        cv->sys = (int)rnd_range(s, 0, c->n_sys - 1);
        cv->len = s->sys_len[cv->sys];
    }
    cv->busy = 1;
    memset(r, 0, sizeof(*r));
    r->state = RQ_WAITING;
    r->conv = ci;
    r->conv_key = cv->key;
    r->sys = cv->sys;
    r->prompt = cv->len + rnd_range(s, 1, c->max_new_prompt);
    r->total = r->prompt + rnd_range(s, 1, c->max_output);
    r->abort_at = rnd_unit(s) < c->abort_rate ? s->st->ticks + rnd_range(s, 0, 200) : -1;
    r->work = r->track[0] = r->track[1] = STEPQ_POOL_SLOT_PAD;
    r->cow_node = -1;
    s->waitq[(s->wq_head + s->wq_len) % s->n_reqs] = idx;
    s->wq_len++;
    s->live++;
    s->issued++;
    s->st->arrived++;
}

/* Frees whatever slots a request holds except keep; -1 stays in the list as padding. */
static int free_req_slots(struct sim *s, struct req *r, int32_t keep)
{
    int32_t ids[3] = { r->work, r->track[0], r->track[1] };

    for (int i = 0; i < 3; i++)
        if (ids[i] == keep)
            ids[i] = STEPQ_POOL_SLOT_PAD;
    if (sim_free(s, ids, 3) < 0)
        return -1;
    r->work = r->track[0] = r->track[1] = STEPQ_POOL_SLOT_PAD;
    return 0;
}

static int finish(struct sim *s, int idx)
{
    struct req *r = &s->reqs[idx];
    int32_t keep = STEPQ_POOL_SLOT_PAD;
    uint64_t key = 0;
    int64_t len = 0;

    if (tag_expect(s, r->work, state_key(s, r, r->total), r->total, "finished state") < 0)
        return -1;
    if (s->cfg->policy == STEPQ_POOL_POLICY_NO_BUFFER) {
        keep = r->work;
        len = r->total;
    } else if (s->tracking && r->last_track > 0) {
        keep = r->track[r->last_track_idx];
        len = r->last_track;
    }
    if (keep != STEPQ_POOL_SLOT_PAD) {
        key = state_key(s, r, len);
        if (tag_expect(s, keep, key, len, "state inserted on finish") < 0)
            return -1;
        if (node_find(s, key, len) >= 0) {
            keep = STEPQ_POOL_SLOT_PAD;
            s->st->duplicate_inserts++;
        }
    }
    if (free_req_slots(s, r, keep) < 0)
        return -1;
    if (keep != STEPQ_POOL_SLOT_PAD && node_insert(s, key, len, keep) < 0)
        return -1;
    s->convs[r->conv].len = r->total;
    s->st->completed++;
    req_release(s, idx);
    return 0;
}

static int abort_req(struct sim *s, int idx)
{
    struct req *r = &s->reqs[idx];

    if (r->cow_node >= 0)
        s->nodes[r->cow_node].lock--;
    r->cow_node = -1;
    if (r->state != RQ_WAITING && free_req_slots(s, r, STEPQ_POOL_SLOT_PAD) < 0)
        return -1;
    s->st->aborted++;
    req_release(s, idx);
    return 0;
}

/* --- checks ---------------------------------------------------------------- */

/* Pool, shadow and the scheduler's references must name the same owner for every slot. */
static int full_check(struct sim *s)
{
    int ret;

    memset(s->expect, OWN_FREE, (size_t)s->cap + 1);
    for (int i = 0; i < s->n_reqs; i++) {
        const struct req *r = &s->reqs[i];

        if (r->state == RQ_FREE || r->state == RQ_WAITING)
            continue;
        s->expect[r->work] = OWN_WORK;
        for (int k = 0; k < 2; k++)
            if (r->track[k] != STEPQ_POOL_SLOT_PAD)
                s->expect[r->track[k]] = OWN_TRACK;
    }
    for (int32_t i = 0; i < s->cap; i++) {
        const struct node *n = &s->nodes[i];

        if (!n->live)
            continue;
        if (n->lock < 0)
            return fail(s, STEPQ_EINTERNAL, "node %" PRId32 " has lock count %d", i, n->lock);
        s->expect[n->slot] = OWN_NODE;
    }
    for (int32_t slot = 0; slot <= s->cap; slot++) {
        int a = stepq_pool_is_allocated(s->pool, slot);

        if (a < 0)
            return fail(s, a, "is_allocated(%" PRId32 "): %s", slot, stepq_last_error());
        if (slot == 0) {
            if (a)
                return fail(s, STEPQ_EINTERNAL, "the sentinel slot 0 is allocated");
            continue;
        }
        if (s->expect[slot] != s->own[slot])
            return fail(s, STEPQ_EINTERNAL,
                        "slot %" PRId32 " is %s in the shadow but %s for the scheduler%s", slot,
                        own_names[s->own[slot]], own_names[s->expect[slot]],
                        s->expect[slot] == OWN_FREE ? " (a leak)" : "");
        if (a != (s->own[slot] != OWN_FREE))
            return fail(s, STEPQ_EINTERNAL, "slot %" PRId32 " is %sallocated in the pool, %s here",
                        slot, a ? "" : "not ", own_names[s->own[slot]]);
    }
    ret = stepq__pool_check(s->pool);
    if (ret < 0)
        return fail(s, ret, "allocator check: %s", stepq_last_error());
    s->st->checks++;
    return check_counters(s, "the tick");
}

static int expect_status(struct sim *s, int got, int want, const char *what)
{
    s->st->injected_errors++;
    s->st->pool_ops++;
    if (got != want)
        return fail(s, STEPQ_EINTERNAL, "%s returned %s, expected %s", what, stepq_status_name(got),
                    stepq_status_name(want));
    return 0;
}

/* Invalid calls: each must fail with its status and leave the pool as it was. */
static int inject(struct sim *s)
{
    int32_t owned = -1, freed = -1, ids[2];
    struct tag before;

    for (int32_t i = 1; i <= s->cap && (owned < 0 || freed < 0); i++) {
        if (s->own[i] != OWN_FREE && owned < 0)
            owned = i;
        if (s->own[i] == OWN_FREE && freed < 0)
            freed = i;
    }
    if (freed > 0 && expect_status(s, stepq_pool_free(s->pool, &freed, 1), STEPQ_EDOUBLEFREE,
                                   "free of a free slot") < 0)
        return -1;
    ids[0] = s->cap + 1;
    if (expect_status(s, stepq_pool_free(s->pool, ids, 1), STEPQ_ERANGE, "free out of range") < 0)
        return -1;
    if (expect_status(s, stepq_pool_alloc(s->pool, s->cap - s->sh_in_use + 1, s->ids), STEPQ_ENOSPC,
                      "over-allocation") < 0)
        return -1;
    if (owned > 0) {
        if (tag_read(s, owned, &before) < 0)
            return -1;
        ids[0] = owned;
        ids[1] = 0;
        if (expect_status(s, stepq_pool_free(s->pool, ids, 2), STEPQ_EINVAL,
                          "free of [slot, sentinel]") < 0)
            return -1;
        ids[1] = owned;
        if (expect_status(s, stepq_pool_free(s->pool, ids, 2), STEPQ_EDOUBLEFREE,
                          "free of a slot listed twice") < 0)
            return -1;
        if (expect_status(s, stepq_pool_copy(s->pool, &owned, &owned, 1), STEPQ_EINVAL,
                          "copy onto itself") < 0)
            return -1;
        if (tag_expect(s, owned, before.key, (int64_t)before.len, "after invalid calls") < 0)
            return -1;
    }
    return full_check(s);
}

/* --- the event loop ----------------------------------------------------------- */

static void close_all(struct sim *s)
{
    if (s->closing)
        return;
    s->closing = 1;
    uv_close((uv_handle_t *)&s->t_arrive, NULL);
    uv_close((uv_handle_t *)&s->t_prefill, NULL);
    uv_close((uv_handle_t *)&s->t_decode, NULL);
    uv_close((uv_handle_t *)&s->t_complete, NULL);
}

static void on_arrive(uv_timer_t *t)
{
    struct sim *s = t->data;
    int64_t k = rnd_range(s, 0, 4);

    if (s->closing)
        return;
    while (k-- > 0 && s->issued < s->cfg->requests && s->n_free_reqs > 0)
        new_request(s);
    if (admit(s) < 0)
        close_all(s);
    else
        uv_timer_start(t, on_arrive, 0, 0);
}

static int prefill_one(struct sim *s, struct req *r, int64_t *budget)
{
    const struct stepq__sim_config *c = s->cfg;
    int64_t boundary = s->sys_len[r->sys] / c->track_interval * c->track_interval;

    if (r->cow_node >= 0) {
        struct node *n = &s->nodes[r->cow_node];

        if (sim_copy(s, n->slot, r->work, "deferred copy-on-write") < 0 ||
            tag_expect(s, r->work, state_key(s, r, n->len), n->len, "prefix hit") < 0)
            return -1;
        n->lock--;
        n->used = s->st->ticks;
        r->cow_node = -1;
        s->st->cow_copies++;
    }
    while (*budget > 0 && r->pos < r->prompt) {
        int64_t end = next_mult(r->pos, c->chunk), start = r->pos;

        if (end > r->prompt)
            end = r->prompt;
        if (r->pos < boundary && boundary < end)
            end = boundary;
        if (end > r->pos + *budget)
            end = r->pos + *budget;
        if (advance(s, r, end) < 0)
            return -1;
        *budget -= end - start;
        s->st->tokens_prefilled += end - start;
        if (c->policy != STEPQ_POOL_POLICY_NO_CACHE && end == boundary && boundary > 0 &&
            fork_prefix(s, r) < 0)
            return -1;
        if (s->tracking && end % c->track_interval == 0 && end > r->last_track && track(s, r) < 0)
            return -1;
    }
    if (r->pos == r->prompt)
        r->state = RQ_DECODE;
    return 0;
}

static void on_prefill(uv_timer_t *t)
{
    struct sim *s = t->data;
    int64_t budget = s->cfg->prefill_tokens;

    if (s->closing)
        return;
    for (int k = 0; k < s->n_running && budget > 0; k++) {
        struct req *r = &s->reqs[s->running[k]];

        if (r->state == RQ_PREFILL && prefill_one(s, r, &budget) < 0) {
            close_all(s);
            return;
        }
    }
    uv_timer_start(t, on_prefill, 0, 0);
}

static void on_decode(uv_timer_t *t)
{
    struct sim *s = t->data;
    const struct stepq__sim_config *c = s->cfg;

    if (s->closing)
        return;
    for (int k = s->n_running - 1; k >= 0; k--) {
        int idx = s->running[k];
        struct req *r = &s->reqs[idx];
        int64_t end;

        if (r->state != RQ_DECODE)
            continue;
        end = r->pos + rnd_range(s, 1, c->max_decode_step);
        if (end > next_mult(r->pos, c->track_interval))
            end = next_mult(r->pos, c->track_interval);
        if (end > r->total)
            end = r->total;
        s->st->tokens_decoded += end - r->pos;
        if (advance(s, r, end) < 0 || (s->tracking && end % c->track_interval == 0 &&
                                       end > r->last_track && track(s, r) < 0)) {
            close_all(s);
            return;
        }
        if (r->pos == r->total) {
            r->state = RQ_DONE;
            running_remove(s, k);
            s->done[s->n_done++] = idx;
        }
    }
    uv_timer_start(t, on_decode, 0, 0);
}

static int complete_tick(struct sim *s)
{
    /* Aborts: running and waiting requests whose time has come. */
    for (int k = s->n_running - 1; k >= 0; k--) {
        int idx = s->running[k];

        if (s->reqs[idx].abort_at >= 0 && s->reqs[idx].abort_at <= s->st->ticks) {
            running_remove(s, k);
            if (abort_req(s, idx) < 0)
                return -1;
        }
    }
    for (int k = 0, n = s->wq_len; k < n; k++) {
        int idx = s->waitq[s->wq_head];

        s->wq_head = (s->wq_head + 1) % s->n_reqs;
        s->wq_len--;
        if (s->reqs[idx].abort_at >= 0 && s->reqs[idx].abort_at <= s->st->ticks) {
            if (abort_req(s, idx) < 0)
                return -1;
        } else {
            s->waitq[(s->wq_head + s->wq_len) % s->n_reqs] = idx;
            s->wq_len++;
        }
    }
    for (int k = 0; k < s->n_done; k++)
        if (finish(s, s->done[k]) < 0)
            return -1;
    s->n_done = 0;
    s->st->ticks++;
    if (s->cfg->progress)
        s->cfg->progress(s->cfg->progress_arg, s->st->completed + s->st->aborted, s->cfg->requests);
    if (full_check(s) < 0)
        return -1;
    if (s->cfg->inject_every > 0 && s->st->ticks % s->cfg->inject_every == 0 && inject(s) < 0)
        return -1;
    if (s->issued == s->cfg->requests && s->live == 0) {
        int e;

        while ((e = evict_one(s)) > 0)
            ;
        if (e < 0 || full_check(s) < 0)
            return -1;
        if (s->sh_in_use != 0)
            return fail(s, STEPQ_EINTERNAL, "%" PRId32 " slots still held after the flush",
                        s->sh_in_use);
        s->finished = 1;
    } else if (s->st->ticks > s->tick_limit) {
        return fail(s, STEPQ_EINTERNAL,
                    "no end after %" PRId64 " ticks: %" PRId64
                    " requests issued, %d live, %d running, %d waiting",
                    s->st->ticks, s->issued, s->live, s->n_running, s->wq_len);
    }
    return 0;
}

static void on_complete(uv_timer_t *t)
{
    struct sim *s = t->data;

    if (s->closing)
        return;
    if (complete_tick(s) < 0 || s->finished)
        close_all(s);
    else
        uv_timer_start(t, on_complete, 0, 0);
}

/* --- setup ------------------------------------------------------------------ */

static int check_config(struct sim *s, const struct stepq__sim_config *c)
{
    if (c->requests < 1 || c->max_running < 1 || c->track_interval < 1 ||
        c->chunk < c->track_interval || c->chunk % c->track_interval || c->prefill_tokens < 1 ||
        c->max_decode_step < 1 || c->max_new_prompt < 1 || c->max_output < 1 || c->n_sys < 1 ||
        !(c->abort_rate >= 0 && c->abort_rate <= 1) ||
        !(c->follow_rate >= 0 && c->follow_rate <= 1) || c->inject_every < 0 ||
        stepq_pool_policy_slots(c->policy) < 0)
        return fail(s, STEPQ_EINVAL,
                    "bad simulation config (requests, max_running, track_interval >= 1, chunk a "
                    "multiple of track_interval, rates in [0, 1], a known policy)");
    /* The stall guard counts ticks per request: its limit must not wrap. */
    if (c->requests > (INT64_MAX - 1000) / TICKS_PER_REQUEST_LIMIT)
        return fail(s, STEPQ_ERANGE, "requests = %" PRId64 " is more than %" PRId64, c->requests,
                    (int64_t)((INT64_MAX - 1000) / TICKS_PER_REQUEST_LIMIT));
    return 0;
}

int stepq__sim_run(stepq_pool_t *pool, const struct stepq__sim_config *cfg,
                   struct stepq__sim_stats *stats, char *err, size_t errlen)
{
    struct sim s0, *s = &s0;
    stepq_pool_stats ps;
    uv_loop_t loop;
    struct timespec t0, t1;
    int ret, B = cfg->max_running;

    memset(s, 0, sizeof(*s));
    memset(stats, 0, sizeof(*stats));
    s->cfg = cfg;
    s->st = stats;
    s->pool = pool;
    s->err = err;
    s->errlen = errlen;
    if (errlen)
        err[0] = '\0';
    if (check_config(s, cfg) < 0)
        return s->status;
    ret = stepq_pool_get_stats(pool, &ps, sizeof(ps));
    if (ret < 0)
        return fail(s, ret, "%s", stepq_last_error());
    if (ps.in_use != 0 || ps.page_bytes < 2 * sizeof(struct tag))
        return fail(s, STEPQ_EINVAL,
                    "the pool must start empty with pages of at least %zu B (in use %" PRId32
                    ", page %" PRIu64 " B)",
                    2 * sizeof(struct tag), ps.in_use, ps.page_bytes);
    s->cap = ps.capacity;
    s->page_bytes = ps.page_bytes;
    s->sh_hw = ps.high_water;
    s->sh_alloc = ps.n_alloc;
    s->sh_free = ps.n_free;
    s->per_req = cfg->policy == STEPQ_POOL_POLICY_EXTRA_BUFFER ? 3 : 1;
    /* A pool that cannot admit one request is the caller's sizing, not a bug:
     * refuse it before any work (it used to end as STEPQ_EINTERNAL at tick 2). */
    if (s->cap < s->per_req)
        return fail(s, STEPQ_ENOSPC,
                    "the pool has %" PRId32 " slots; policy %s needs %d for one request "
                    "(raise --budget or --max-running)",
                    s->cap, stepq_pool_policy_name(cfg->policy), s->per_req);
    s->tracking =
        cfg->policy == STEPQ_POOL_POLICY_EXTRA_BUFFER || cfg->policy == STEPQ_POOL_POLICY_LAZY;
    s->rng = cfg->seed;
    s->n_reqs = INFLIGHT_PER_RUNNING * B + 1;
    s->n_convs = CONVS_PER_RUNNING * B;
    s->next_conv_key = 1;
    s->tick_limit = TICKS_PER_REQUEST_LIMIT * cfg->requests + 1000;

    s->reqs = calloc((size_t)s->n_reqs, sizeof(*s->reqs));
    s->free_reqs = calloc((size_t)s->n_reqs, sizeof(int));
    s->waitq = calloc((size_t)s->n_reqs, sizeof(int));
    s->running = calloc((size_t)s->n_reqs, sizeof(int));
    s->done = calloc((size_t)s->n_reqs, sizeof(int));
    s->convs = calloc((size_t)s->n_convs, sizeof(*s->convs));
    s->sys_len = calloc((size_t)cfg->n_sys, sizeof(*s->sys_len));
    s->nodes = calloc((size_t)s->cap, sizeof(*s->nodes));
    s->own = calloc((size_t)s->cap + 1, 1);
    s->expect = calloc((size_t)s->cap + 1, 1);
    s->ids = calloc((size_t)s->cap + 2, sizeof(*s->ids));
    if (!s->ids || !s->reqs || !s->free_reqs || !s->waitq || !s->running || !s->done || !s->convs ||
        !s->sys_len || !s->nodes || !s->own || !s->expect) {
        fail(s, STEPQ_ENOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < s->n_reqs; i++)
        s->free_reqs[s->n_free_reqs++] = s->n_reqs - 1 - i;
    for (int i = 0; i < cfg->n_sys; i++)
        s->sys_len[i] = rnd_range(s, 100, 2000);
    for (int i = 0; i < s->n_convs; i++)
        s->convs[i].sys = 0;

    if ((ret = uv_loop_init(&loop)) < 0) {
        fail(s, STEPQ_EIO, "uv_loop_init: %s", uv_strerror(ret));
        goto out;
    }
    uv_timer_init(&loop, &s->t_arrive);
    uv_timer_init(&loop, &s->t_prefill);
    uv_timer_init(&loop, &s->t_decode);
    uv_timer_init(&loop, &s->t_complete);
    s->t_arrive.data = s->t_prefill.data = s->t_decode.data = s->t_complete.data = s;
    /* Zero timeouts, started in this order: one round of the four is one tick. */
    uv_timer_start(&s->t_arrive, on_arrive, 0, 0);
    uv_timer_start(&s->t_prefill, on_prefill, 0, 0);
    uv_timer_start(&s->t_decode, on_decode, 0, 0);
    uv_timer_start(&s->t_complete, on_complete, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uv_run(&loop, UV_RUN_DEFAULT);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    uv_loop_close(&loop);
    stats->seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    stats->max_in_use = s->sh_hw;
    stats->capacity = s->cap;
    if (!s->failed && !s->finished)
        fail(s, STEPQ_EINTERNAL, "the event loop ended before the run finished");
    if (!s->failed && stats->completed + stats->aborted != cfg->requests)
        fail(s, STEPQ_EINTERNAL, "%" PRId64 " completed + %" PRId64 " aborted != %" PRId64,
             stats->completed, stats->aborted, cfg->requests);
out:
    free(s->reqs);
    free(s->free_reqs);
    free(s->waitq);
    free(s->running);
    free(s->done);
    free(s->convs);
    free(s->sys_len);
    free(s->nodes);
    free(s->own);
    free(s->expect);
    free(s->ids);
    return s->failed ? s->status : STEPQ_OK;
}
