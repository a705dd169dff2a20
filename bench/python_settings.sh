# Sourced by the side-by-side benches (bench/ddp_step.sh, bench/trainer_vs_python.sh): the settings
# that give a Python process what ctorch gives itself (docs/performance.md, "Like for like").
# same_allocator: ctorch::tuneAllocator's two mallopt values (trainer/src/core/process_tuning.cpp),
# as glibc reads them from the environment.
same_allocator=(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824)
# The variables either side reads for threads and the heap, cleared so that each run sets its own.
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS GOTO_NUM_THREADS MALLOC_MMAP_THRESHOLD_ MALLOC_TRIM_THRESHOLD_ \
  GLIBC_TUNABLES || true
