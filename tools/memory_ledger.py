"""Print the start-up memory ledger of a configuration without loading weights or using a GPU.

The network is built on the meta device to count its parameters (routed experts apart); the
GPU holds everything else plus `--kt-num-gpu-experts` experts per MoE layer (and, with
`--kt-gpu-prefill-token-threshold`, two full layers of experts for layerwise prefill); the other
experts sit in pinned host memory. The cache, workspaces and graphs are planned exactly as the
engine plans them (engine/memory_plan.py), against a GPU of `--gpu-gib`.

    python tools/memory_ledger.py --context-length 1048576 --kt-num-gpu-experts 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from glmflash.config import ModelConfig  # noqa: E402
from glmflash.engine.cuda_graph import graph_batch_sizes  # noqa: E402
from glmflash.engine.memory_ledger import GIB, PINNED, MemoryLedger  # noqa: E402
from glmflash.engine.memory_plan import DeviceMemory, plan_memory  # noqa: E402
from glmflash.engine.options import INDEX_KEY_DTYPES, EngineConfig  # noqa: E402
from glmflash.model.glm import GlmForCausalLM  # noqa: E402
from glmflash.model.moe import Experts  # noqa: E402

RELEASE_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "release_config.json"
# What the CUDA context and the libraries take on an H200 before any tensor.
CUDA_CONTEXT_GIB = 0.6


def parameter_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, list[int]]:
    """(bytes of everything but the routed experts, bytes of each MoE layer's routed experts)."""
    with torch.device("meta"):
        model = GlmForCausalLM(config, dtype)
    expert_params = set()
    layers = []
    for module in model.modules():
        if isinstance(module, Experts):
            params = list(module.parameters())
            expert_params.update(id(p) for p in params)
            layers.append(sum(p.numel() * p.element_size() for p in params))
    rest = sum(p.numel() * p.element_size() for p in model.parameters()
               if id(p) not in expert_params)
    return rest, layers


def gpu_weight_bytes(config: ModelConfig, options: EngineConfig, dtype: torch.dtype
                     ) -> tuple[int, int]:
    """(GPU bytes of the placed weights, pinned host bytes of the CPU experts)."""
    rest, layers = parameter_bytes(config, dtype)
    if options.kt_num_gpu_experts is None or not layers:
        return rest + sum(layers), 0
    per_expert = layers[0] // config.n_routed_experts
    resident = options.kt_num_gpu_experts * per_expert * len(layers)
    streaming = 2 * layers[0] if options.kt_gpu_prefill_token_threshold is not None else 0
    return rest + resident + streaming, sum(layers)


def release_ledger(options: EngineConfig, gpu_gib: float, config_path: Path = RELEASE_CONFIG,
                   dtype: torch.dtype = torch.bfloat16) -> MemoryLedger:
    """The ledger the engine would log on a GPU of `gpu_gib` (raises MemoryPlanError)."""
    config = ModelConfig.from_hf(config_path)
    gpu, pinned = gpu_weight_bytes(config, options, dtype)
    total = int(gpu_gib * GIB)
    context = int(CUDA_CONTEXT_GIB * GIB)
    memory = DeviceMemory(total=total, free=total - context - gpu, allocated=gpu, reserved=gpu)
    sizes = [] if options.disable_cuda_graph else graph_batch_sizes(
        options.cuda_graph_bs, options.cuda_graph_max_bs, options.max_running_requests,
        options.kt_gpu_prefill_token_threshold)
    max_seq_len = options.context_length or config.max_position_embeddings
    _, ledger = plan_memory(config, options, max_seq_len, torch.device("cuda"), dtype,
                            graph_sizes=sizes, memory=memory)
    ledger.row("weights and buffers").how = "from sizes"
    ledger.row("CUDA context, other processes").how = "assumed"
    ledger.row("allocator cache").how = "assumed"
    if pinned:
        ledger.add("routed experts (CPU)", PINNED, pinned, "from sizes", "FP8 + scales")
    return ledger


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=RELEASE_CONFIG)
    p.add_argument("--gpu-gib", type=float, default=139.8, help="device memory (H200: 139.8)")
    p.add_argument("--context-length", type=int, default=1048576)
    p.add_argument("--max-running-requests", type=int, default=1)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--kt-num-gpu-experts", type=int, default=None)
    p.add_argument("--kt-gpu-prefill-token-threshold", type=int, default=None)
    p.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    p.add_argument("--index-key-dtype", default="auto", choices=INDEX_KEY_DTYPES)
    args = p.parse_args()
    options = EngineConfig(context_length=args.context_length,
                           max_running_requests=args.max_running_requests,
                           chunked_prefill_size=args.chunked_prefill_size,
                           mem_fraction_static=args.mem_fraction_static,
                           kt_num_gpu_experts=args.kt_num_gpu_experts,
                           kt_gpu_prefill_token_threshold=args.kt_gpu_prefill_token_threshold,
                           cuda_graph_bs=tuple(args.cuda_graph_bs) if args.cuda_graph_bs
                           else None, index_key_dtype=args.index_key_dtype)
    print(release_ledger(options, args.gpu_gib, args.config).table())


if __name__ == "__main__":
    main()
