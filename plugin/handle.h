/*
 * Handles for the library's objects (pools, maps): a handle is not the
 * object's address. It names an entry of a table whose entries are never
 * freed or moved, as (generation << 32) | (index + 1), and the entry holds
 * the object, its kind, its current generation and a mutex the object's
 * calls may use. Dropping an object bumps the generation, so a handle of a
 * closed object can never become valid again, whatever later reuses the
 * object's memory or the entry (no ABA), and a pool's handle passed where a
 * map's is expected is refused. Lookups are lock-free: their cost does not
 * depend on how many objects exist, and calls on different objects share
 * no lock. The table lock is taken only to add and drop.
 */
#ifndef STEPQ_PLUGIN_HANDLE_H
#define STEPQ_PLUGIN_HANDLE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/** What a handle names. */
enum stepq__handle_kind {
    STEPQ__HANDLE_POOL = 1,
    STEPQ__HANDLE_MAP = 2,
    STEPQ__HANDLE_TP_COMM = 3,
};

/*
 * One cache line per entry: entries of different pools sit side by side in
 * the table, and threads locking neighbouring pools' mutexes must not share
 * a line (measured on 16 cores before the padding: two threads on two pools
 * made 0.46x the calls of one).
 */
#define STEPQ__HANDLE_ALIGN 64

struct stepq__handle_entry {
    _Alignas(STEPQ__HANDLE_ALIGN) pthread_mutex_t mu; /* for the object's calls (a pool's lock) */
    _Atomic uint32_t gen;                             /* bumped by every drop */
    void *_Atomic obj;                                /* NULL while the entry is free */
    _Atomic int kind;                                 /* enum stepq__handle_kind of obj */
    uint32_t index;                                   /* of this entry */
};

/** The text of every stale-handle error. */
extern const char stepq__handle_closed_text[];

/**
 * Gives obj a handle (*handle) and its entry (*entry). STEPQ_ENOMEM (message
 * in err, which may be NULL) when the table cannot grow.
 */
int stepq__handle_add(void *obj, int kind, void **handle, struct stepq__handle_entry **entry,
                      char *err);

/**
 * The entry a handle names and the generation it carries, or NULL for a
 * value no add ever returned. The caller compares the generation (under the
 * entry's mutex where the object can be dropped concurrently).
 */
struct stepq__handle_entry *stepq__handle_entry_of(const void *handle, uint32_t *gen);

/** The entry's object, when the entry still holds generation gen and an object of kind. */
static inline void *stepq__handle_live(struct stepq__handle_entry *e, uint32_t gen, int kind)
{
    void *obj = atomic_load_explicit(&e->obj, memory_order_acquire);

    if (!obj || atomic_load_explicit(&e->gen, memory_order_acquire) != gen ||
        atomic_load_explicit(&e->kind, memory_order_relaxed) != kind)
        return NULL;
    return obj;
}

/**
 * The object of a live handle of this kind, or NULL (stale, foreign or never
 * issued). Lock-free: for objects whose drop may not race with their use.
 */
void *stepq__handle_get(const void *handle, int kind);

/**
 * Ends an object's handle: bumps the generation and frees the entry. The
 * caller holds e->mu when other threads may be waiting on it; it is not
 * released here.
 */
void stepq__handle_drop(struct stepq__handle_entry *e);

#endif /* STEPQ_PLUGIN_HANDLE_H */
