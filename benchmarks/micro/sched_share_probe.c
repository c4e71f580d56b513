/* A process shaped like a CPU inference server's, for benchmarks/micro/sched_share.py.
 *
 *   sched_share_probe PIN WAKERS WAKER_US SIBLING_PERCENT
 *
 * The main thread spins (the model's op thread), bound to CPU 0 when PIN is 1.
 * WAKERS threads (bound with it) sleep WAKER_US microseconds at a time and do a
 * few microseconds of work at each wake (a polling runtime's threads: gloo,
 * ZMQ). With SIBLING_PERCENT > 0 a forked child of the same session, unbound,
 * computes that share of every 10 ms and sleeps the rest (a second process of
 * the server: its engine loop or HTTP frontend). Runs until killed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long waker_us = 1000;

static void bind_to_cpu0(void) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static long elapsed_us(const struct timespec *from) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - from->tv_sec) * 1000000L + (now.tv_nsec - from->tv_nsec) / 1000;
}

static void *waker(void *unused) {
    (void)unused;
    for (;;) {
        usleep((useconds_t)waker_us);
        volatile int sum = 0;
        for (int i = 0; i < 1000; i++) sum += i;
    }
    return NULL;
}

static void sibling(long percent) {
    struct timespec start;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &start);
        while (elapsed_us(&start) < percent * 100) {
        }
        usleep((useconds_t)((100 - percent) * 100));
    }
}

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    int pin = atoi(argv[1]), wakers = atoi(argv[2]);
    waker_us = atol(argv[3]);
    long sibling_percent = atol(argv[4]);
    if (sibling_percent > 0 && fork() == 0) sibling(sibling_percent);
    if (pin) bind_to_cpu0();
    for (int i = 0; i < wakers; i++) {
        pthread_t thread;
        pthread_create(&thread, NULL, waker, NULL);
    }
    volatile double x = 0;
    for (;;) x += 1.0;
}
