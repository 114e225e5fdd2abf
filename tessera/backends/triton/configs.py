"""Launch configurations: a tuning table keyed by GPU and head dim, with defaults for anything not in it.

``benchmarks/gpu.py --tune`` measures candidates on a lent GPU and prints entries in this table's format; measured
entries are added to :data:`TUNED` with the card and date they came from. A config changes only speed, never
results, so the conformance suite runs the interpreter configs and a compile check covers the GPU ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchConfig:
    """One kernel launch shape. ``block_m`` counts (token, head) rows; ``block_n`` keys per kv tile."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class Configs:
    prefill: LaunchConfig
    decode: LaunchConfig
    #: split decode items until about this many programs run (a couple of waves of the GPU's SMs)
    target_programs: int
    #: never split below this many kv tiles per split (each split costs a partial write and a merge read)
    min_tiles_per_split: int


# (device-name substring, max head dim) -> configs. Filled from `benchmarks/gpu.py --tune` runs; the first match wins.
TUNED: dict[tuple[str, int], Configs] = {}


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def configs_for(device: torch.device, head_dim: int) -> Configs:
    """The tuned entry for this GPU and head dim, else the defaults below."""
    if interpreting() or device.type != "cuda":
        # Small tiles so test-sized inputs still cover multi-tile loops, partial tiles and split-KV; few "SMs" so
        # decode items get split.
        return Configs(LaunchConfig(32, 32), LaunchConfig(16, 16), target_programs=8, min_tiles_per_split=2)
    name = torch.cuda.get_device_name(device)
    for (card, max_d), cfg in TUNED.items():
        if card in name and head_dim <= max_d:
            return cfg
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return default_configs(head_dim, sms)


def default_configs(head_dim: int, sms: int) -> Configs:
    """Defaults for NVIDIA GPUs with >= 100 KB of shared memory per SM (Ampere and Hopper)."""
    if head_dim <= 64:
        prefill = LaunchConfig(128, 64, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        prefill = LaunchConfig(128, 64, num_warps=8, num_stages=3)
    else:
        prefill = LaunchConfig(64, 32, num_warps=4, num_stages=2)
    decode = LaunchConfig(16, 64 if head_dim <= 128 else 32, num_warps=4, num_stages=3)
    return Configs(prefill, decode, target_programs=2 * sms, min_tiles_per_split=4)
