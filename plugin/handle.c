/* The handle table (plugin/handle.h). */
#include <stdlib.h>
#include <string.h>

#include "plugin/err.h"
#include "plugin/handle.h"

#define ENTRIES_PER_CHUNK 1024
#define MAX_CHUNKS        4096 /* 4M objects at once */

_Static_assert(sizeof(uintptr_t) == 8, "handles pack a 32-bit generation and index");
_Static_assert(sizeof(struct stepq__handle_entry) % STEPQ__HANDLE_ALIGN == 0,
               "entries fill whole cache lines");

const char stepq__handle_closed_text[] = "handle is closed or not valid";

static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static struct stepq__handle_entry *_Atomic chunks[MAX_CHUNKS];
static uint32_t n_entries;  /* entries ever made (under table_mu) */
static uint32_t *free_list; /* indices of free entries (under table_mu) */
static uint32_t n_free, cap_free;

int stepq__handle_add(void *obj, int kind, void **handle, struct stepq__handle_entry **entry,
                      char *err)
{
    struct stepq__handle_entry *e;
    uint32_t index;
    int ret = STEPQ_OK, full = 0;

    pthread_mutex_lock(&table_mu);
    if (n_free > 0) {
        index = free_list[--n_free];
    } else if (n_entries == (uint32_t)MAX_CHUNKS * ENTRIES_PER_CHUNK) {
        ret = STEPQ_ENOMEM;
        full = 1;
        goto out;
    } else {
        index = n_entries;
        if (index % ENTRIES_PER_CHUNK == 0) {
            struct stepq__handle_entry *c =
                aligned_alloc(STEPQ__HANDLE_ALIGN, ENTRIES_PER_CHUNK * sizeof(*c));
            if (c)
                memset(c, 0, ENTRIES_PER_CHUNK * sizeof(*c));
            if (!c) {
                ret = STEPQ_ENOMEM;
                goto out;
            }
            for (uint32_t k = 0; k < ENTRIES_PER_CHUNK; k++) {
                pthread_mutex_init(&c[k].mu, NULL);
                atomic_init(&c[k].gen, 1);
                c[k].index = index + k;
            }
            atomic_store_explicit(&chunks[index / ENTRIES_PER_CHUNK], c, memory_order_release);
        }
        n_entries++;
    }
    e = &atomic_load_explicit(&chunks[index / ENTRIES_PER_CHUNK],
                              memory_order_relaxed)[index % ENTRIES_PER_CHUNK];
    atomic_store_explicit(&e->kind, kind, memory_order_relaxed);
    atomic_store_explicit(&e->obj, obj, memory_order_release);
    *entry = e;
    *handle = (void *)(uintptr_t)(((uint64_t)atomic_load(&e->gen) << 32) | ((uint64_t)index + 1));
out:
    pthread_mutex_unlock(&table_mu);
    /* The text is set outside the lock: setting it may call the host's
     * logger, which may open maps and pools itself. */
    if (full)
        return stepq__error_obj(err, ret, "%u objects are open: the handle table is full",
                                (uint32_t)MAX_CHUNKS * ENTRIES_PER_CHUNK);
    if (ret < 0)
        return stepq__error_obj(err, ret, "out of memory (handle table)");
    return ret;
}

struct stepq__handle_entry *stepq__handle_entry_of(const void *handle, uint32_t *gen)
{
    const uintptr_t v = (uintptr_t)handle;
    const uint32_t low = (uint32_t)v;
    struct stepq__handle_entry *chunk;

    if (low == 0 || low - 1 >= (uint32_t)MAX_CHUNKS * ENTRIES_PER_CHUNK)
        return NULL;
    chunk = atomic_load_explicit(&chunks[(low - 1) / ENTRIES_PER_CHUNK], memory_order_acquire);
    if (!chunk)
        return NULL;
    *gen = (uint32_t)(v >> 32);
    return &chunk[(low - 1) % ENTRIES_PER_CHUNK];
}

void *stepq__handle_get(const void *handle, int kind)
{
    uint32_t gen = 0;
    struct stepq__handle_entry *e = stepq__handle_entry_of(handle, &gen);

    return e ? stepq__handle_live(e, gen, kind) : NULL;
}

void stepq__handle_drop(struct stepq__handle_entry *e)
{
    /* An entry whose generation would wrap is retired, so no handle ever comes back. */
    const uint32_t gen = atomic_fetch_add(&e->gen, 1) + 1;

    atomic_store_explicit(&e->obj, NULL, memory_order_release);
    pthread_mutex_lock(&table_mu);
    if (gen != UINT32_MAX) {
        if (n_free == cap_free) {
            uint32_t cap = cap_free ? 2 * cap_free : 64;
            uint32_t *f = realloc(free_list, cap * sizeof(*f));
            if (f) {
                free_list = f;
                cap_free = cap;
            }
        }
        /* Out of memory for the list: the entry is retired, nothing breaks. */
        if (n_free < cap_free)
            free_list[n_free++] = e->index;
    }
    pthread_mutex_unlock(&table_mu);
}
