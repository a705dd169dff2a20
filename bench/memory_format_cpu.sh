#!/usr/bin/env bash
# Channels-last against contiguous on the CPU, 1 rank, 1 thread: the seeds' CNN (Fashion-MNIST, 2048
# samples, batch 64) and ResNet-18 (CIFAR-shaped synthetic images, 64 samples, batch 16), rounds
# alternating the two layouts. Prints each run's epoch time and throughput.
# Usage: bench/memory_format_cpu.sh CTORCH_TRAIN [ROUNDS]   (inside the modern root: scripts/modern.sh run ...)
set -euo pipefail
exe=$(realpath "$1"); rounds=${2:-2}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cnn=(--train-limit 2048 --test-limit 100 --batch-size 64)
resnet=(--model resnet18 --dataset synthetic-images --synthetic-shape 3,32,32 --synthetic-size 64 --test-limit 16
        --batch-size 16 --eval-batch-size 16 --augment off)
for round in $(seq "$rounds"); do
  for model in cnn resnet; do
    for format in contiguous channels-last; do
      if [ "$model" = cnn ]; then args=("${cnn[@]}"); else args=("${resnet[@]}"); fi
      rm -rf "$work/run"; mkdir "$work/run"
      line=$(cd "$work/run" && OMP_NUM_THREADS=1 "$exe" "${args[@]}" --epochs 1 --threads 1 --progress none \
               --resume never --memory-format "$format" 2>&1 | grep -o 'done: [0-9]* steps in [^,]*, [0-9]* samples/s' | head -1)
      echo "round $round $model $format: $line"
    done
  done
done
