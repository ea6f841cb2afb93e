"""How long a test waits for a process it started: a guard against a hang, not a test of speed.

A wall-clock limit fails good code on a loaded machine (a second job on the two cores made the bench smoke runs
miss a 420 s limit); what a test bounds is the work (a --fast mode, a few batches). This guard only turns a real
hang into a failure well before CI's own limit."""

HANG_GUARD_S = 2400
