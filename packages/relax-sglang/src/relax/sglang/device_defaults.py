"""Per-device defaults of the SGLang server settings that ``engine_params`` leaves unset (``None``).

CPU keeps the values the CPU test suite was tuned with (a float32 server at the run's dtype, a 4096-token KV
pool, deterministic inference so request seeds are honoured, 64 ``/generate`` calls in flight). A CUDA server
gets what SGLang users run in production: bf16 (or the run's dtype when it is not float32), a KV pool that
SGLang sizes itself from ``mem_fraction_static``, SGLang's fast non-deterministic kernels unless asked, and
enough requests in flight to fill its continuous batch. Pure: unit-tested for both devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.sglang.params import SGLangEngineParams

CPU_MAX_TOTAL_TOKENS = 4096  # the KV pool a CPU server allocates (SGLang would size it from host RAM)
CPU_MAX_CONCURRENCY = 64
CUDA_MAX_CONCURRENCY = 1024  # the server batches what it can hold and queues the rest itself
FLOAT32 = ("float32", "fp32", "float")


@dataclass(frozen=True)
class ServerSettings:
    """What the launch command and the client use, every field decided."""

    dtype: str
    max_total_tokens: int | None  # None: no cap (SGLang sizes the KV pool from mem_fraction_static)
    deterministic: bool
    max_concurrency: int


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def default_dtype(device: str, run_dtype: str) -> str:
    """CPU: the run's dtype (float32 by default, so the tests compare with the HF engine exactly). CUDA: the
    run's dtype when it chose a half precision, else bf16 (a float32 GPU server is slow and rarely wanted)."""
    if is_cuda(device) and run_dtype in FLOAT32:
        return "bfloat16"
    return run_dtype


#: SGLang's attention backend that takes float32 on every CUDA GPU: its default on Hopper (FA3) takes fp16 / bf16 /
#: fp8 only, so a float32 server there would fail at start-up or at its first request
FLOAT32_CUDA_ATTENTION = "triton"


def cuda_attention_backend(device: str, served_dtype: str) -> str | None:
    """The ``--attention-backend`` a CUDA server at ``served_dtype`` needs (None: SGLang's default is fine).
    The CPU's own backend is part of its fixed settings (``server.server_command``)."""
    return FLOAT32_CUDA_ATTENTION if is_cuda(device) and served_dtype in FLOAT32 else None


def server_settings(params: SGLangEngineParams, run_dtype: str) -> ServerSettings:
    """``params`` with each unset (``None``) field at its device's default; ``max_total_tokens: 0`` asks for
    no cap on either device."""
    cuda = is_cuda(params.device)
    if params.max_total_tokens is None:
        tokens = None if cuda else CPU_MAX_TOTAL_TOKENS
    else:
        tokens = params.max_total_tokens or None
    return ServerSettings(
        dtype=params.dtype or default_dtype(params.device, run_dtype),
        max_total_tokens=tokens,
        deterministic=(not cuda) if params.deterministic is None else params.deterministic,
        max_concurrency=params.max_concurrency or (CUDA_MAX_CONCURRENCY if cuda else CPU_MAX_CONCURRENCY),
    )


def staging_devices(
    device: str, servers: int, tp_size: int, launched: bool = True
) -> list[list[torch.device]]:
    """Where ``sglang_tensor`` stages a bucket for each server's tensor-parallel ranks: ``[server][tp rank]``.
    A launched CUDA server ``j`` runs its rank ``k`` on the engine's GPU ``j * tp_size + k`` (``--base-gpu-id``;
    SGLang's GPU of a rank is base + rank), so that rank's copy is staged there: CUDA IPC then opens no context
    on another GPU (~0.5 GB each) and pulls nothing across, and no GPU holds every server's payload. Host memory
    for a CPU server (one copy, shared); the engine's current GPU for attached servers (their GPUs are unknown)."""
    if not is_cuda(device):
        return [[torch.device("cpu")] * tp_size for _ in range(servers)]
    if not launched:
        return [[torch.device("cuda")] * tp_size for _ in range(servers)]
    return [[torch.device("cuda", j * tp_size + k) for k in range(tp_size)] for j in range(servers)]
