/*
 * The host's logger (stepq/plugin.h): the one place the library's messages
 * leave it. The library never writes to stdout or stderr itself.
 *
 * The callback and its user pointer are read together under a read lock
 * that is held while the callback runs, so stepq_set_logger() (the write
 * lock) returns only once no thread is inside the previous callback: a
 * host may free its user data or unload its logger right after. Errors are
 * rare, so the lock costs nothing that matters; with no logger set a
 * failing call does not take it at all.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

#include "plugin/err.h"
#include "stepq/plugin.h"

static pthread_rwlock_t logger_lock = PTHREAD_RWLOCK_INITIALIZER;
static stepq_log_fn logger_fn;  /* under logger_lock */
static void *logger_user;       /* under logger_lock */
static atomic_int logger_set;   /* logger_fn != NULL, read without the lock */
static _Thread_local int in_cb; /* this thread is inside the callback */

int stepq_set_logger(stepq_log_fn fn, void *user)
{
    /* The write lock would wait for this thread's own read lock forever. */
    if (in_cb)
        return stepq__error(STEPQ_EBUSY,
                            "stepq_set_logger: called from inside the logger callback");
    pthread_rwlock_wrlock(&logger_lock);
    logger_fn = fn;
    logger_user = fn ? user : NULL;
    atomic_store_explicit(&logger_set, fn != NULL, memory_order_release);
    pthread_rwlock_unlock(&logger_lock);
    return STEPQ_OK;
}

void stepq__log(int level, const char *msg)
{
    /* A message set by a stepq call the callback itself made is not logged:
     * the callback would be re-entered, without end if that call fails
     * every time. */
    if (in_cb || !atomic_load_explicit(&logger_set, memory_order_acquire))
        return;
    pthread_rwlock_rdlock(&logger_lock);
    if (logger_fn) {
        in_cb = 1;
        logger_fn(logger_user, level, msg);
        in_cb = 0;
    }
    pthread_rwlock_unlock(&logger_lock);
}
