// The whole public API of ctorch in one include: what a user's training program needs (the process
// group, DistributedDataParallel, ZeRO, FSDP and HSDP, the parameter server, pipelines, the sampler,
// snapshots and ResilientTraining, the optimizers, AMP, CUDA graphs, TensorBoard, the error file and
// stop signals). The headers it includes are the installed ones, each usable alone. docs/library-layout.md.
#pragma once

// set-up, the process group and collectives
#include "ctorch/version.hpp"
#include "ctorch/errors.hpp"
#include "ctorch/error_file.hpp"
#include "ctorch/stop_signal.hpp"
#include "ctorch/process_tuning.hpp"
#include "ctorch/distributed_env.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/collectives.hpp"
#include "ctorch/flat_collectives.hpp"
#include "ctorch/hybrid_shard_groups.hpp"

// data
#include "ctorch/sampler.hpp"
#include "ctorch/memory_format.hpp"

// the strategies
#include "ctorch/comm_hook.hpp"
#include "ctorch/ddp.hpp"
#include "ctorch/module_traversal.hpp"
#include "ctorch/fsdp_unit.hpp"
#include "ctorch/unit_sequential.hpp"
#include "ctorch/fully_sharded_data_parallel.hpp"
#include "ctorch/zero_redundancy_optimizer.hpp"
#include "ctorch/parameter_server.hpp"
#include "ctorch/pipeline.hpp"

// the step
#include "ctorch/optim.hpp"
#include "ctorch/amp.hpp"
#include "ctorch/cuda_graph.hpp"

// state: snapshots and fault tolerance
#include "ctorch/state_dict.hpp"
#include "ctorch/durable_io.hpp"
#include "ctorch/snapshot.hpp"
#include "ctorch/sharded_snapshot.hpp"
#include "ctorch/stateful.hpp"
#include "ctorch/resilience.hpp"

// metrics
#include "ctorch/tensorboard.hpp"
