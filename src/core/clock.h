/* clock.h - monotonic time for throughput figures. */
#ifndef EMBER_CORE_CLOCK_H
#define EMBER_CORE_CLOCK_H

/* Seconds since an arbitrary fixed point, monotonic. */
double ember_now(void);

#endif
