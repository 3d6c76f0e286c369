"""Run megatron-core 0.16.x on a machine without a GPU.

megatron-core's CPU path is sound (gloo collectives, the local non-Transformer-Engine layer spec), but a
few call sites reach for CUDA directly. Each :class:`Patch` below covers exactly one of them, names the
megatron-core code it covers, and is reversible. :func:`ensure_cpu_compat` applies them all when
``torch.cuda.is_available()`` is false. On a GPU megatron runs unpatched, but for one patch that is about
Transformer Engine, not CUDA: ``moe_router_gemm`` (megatron's MoE router refers to a name bound only
when TE imports) applies on any host whose megatron has no TE (:func:`patches_needed`).

``tests/test_cpu_compat.py`` checks, per patch, that the megatron code still fails without it (so a patch
that an upgrade made unnecessary is noticed and dropped) and works with it.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Patch:
    """One CPU workaround: ``install()`` applies it and returns the function that undoes it."""

    name: str
    covers: str  # the megatron-core (or torch) code it makes work on CPU
    install: Callable[[], Callable[[], None]]


def _set_attrs(owner: Any, **values: Any) -> Callable[[], None]:
    """Set attributes on ``owner``; return an undo that restores the old values (or deletes new ones)."""
    missing = object()
    old = {name: getattr(owner, name, missing) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)

    def undo() -> None:
        for name, value in old.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return undo


def _current_device() -> Callable[[], None]:
    # megatron/core/models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.get_emb:
    #   self.inv_freq.to(device=torch.cuda.current_device())  (also used for buffers across the package)
    return _set_attrs(torch.cuda, current_device=lambda: CPU)


def _synchronize() -> Callable[[], None]:
    # megatron/core/timers.py Timer.start/stop, pipeline_parallel/p2p_communication.py _batched_p2p_ops,
    # parallel_state.py: bare torch.cuda.synchronize() calls. On CPU every op is already synchronous.
    return _set_attrs(torch.cuda, synchronize=lambda device=None: None)


def _torch_cuda_rng() -> Callable[[], None]:
    # megatron/core/tensor_parallel/random.py CudaRNGStatesTracker.add and model_parallel_cuda_manual_seed:
    #   torch.cuda.get_rng_state() / torch.cuda.manual_seed(seed). The "CUDA" stream becomes the CPU one.
    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(state)

    return _set_attrs(
        torch.cuda,
        get_rng_state=lambda device="cuda": torch.get_rng_state(),
        set_rng_state=set_rng_state,
        # not torch.manual_seed: that calls torch.cuda.manual_seed_all, which stays lazy (harmless) on CPU
        manual_seed=lambda seed: torch.default_generator.manual_seed(int(seed)),
    )


def _megatron_rng_helpers() -> Callable[[], None]:
    # megatron/core/tensor_parallel/random.py _get_cuda_rng_state / _set_cuda_rng_state index
    # torch.cuda.default_generators directly (used by get_cuda_rng_tracker().fork() and the tracker's
    # add/reset); route them to the CPU generator.
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    return _set_attrs(mrandom, _get_cuda_rng_state=get_state, _set_cuda_rng_state=set_state)


def _schedules_cuda_tensors() -> Callable[[], None]:
    # megatron/core/pipeline_parallel/schedules.py forward_backward_no_pipelining, ..._with_interleaving and
    # ..._without_interleaving: total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda").
    # The module's ``torch`` becomes a view of torch whose ``zeros`` maps device "cuda" to the CPU.
    from megatron.core.pipeline_parallel import schedules

    real = schedules.torch

    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = CPU
        return real.zeros(*args, **kwargs)

    class _TorchView(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    proxy = _TorchView("torch")
    proxy.zeros = zeros
    return _set_attrs(schedules, torch=proxy)


def _default_causal_mask() -> Callable[[], None]:
    # megatron/core/transformer/utils.py get_default_causal_mask (imported by name into
    # fusions/fused_softmax.py, used when attention_mask is None): torch.ones(sq, sq, device="cuda").
    import functools

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    @functools.lru_cache
    def causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device=CPU), diagonal=1).bool()

    undo_utils = _set_attrs(utils, get_default_causal_mask=causal_mask)
    undo_softmax = _set_attrs(fused_softmax, get_default_causal_mask=causal_mask)

    def undo() -> None:
        undo_softmax()
        undo_utils()

    return undo


def _tied_embedding_sync() -> Callable[[], None]:
    # megatron/core/models/common/language_module/language_module.py
    # LanguageModule.setup_embeddings_and_output_layer (PP>1 with tied embeddings): weight.data.cuda()
    # before the first/last-stage all-reduce. ``Tensor.cuda`` is the identity while that method runs.
    import functools

    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup(self: Any) -> None:
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t
        try:
            original(self)
        finally:
            torch.Tensor.cuda = real_cuda

    return _set_attrs(LanguageModule, setup_embeddings_and_output_layer=setup)


def _moe_router_gemm() -> Callable[[], None]:
    # megatron/core/transformer/moe/moe_utils.py RouterGatingLinearFunction.forward/backward test
    # ``te_general_gemm is not None``, but the name is only bound when Transformer Engine imports: NameError.
    from megatron.core.transformer.moe import moe_utils

    return _set_attrs(moe_utils, te_general_gemm=None)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "current_device",
        "rotary_pos_embedding.RotaryEmbedding.get_emb: torch.cuda.current_device()",
        _current_device,
    ),
    Patch(
        "synchronize",
        "timers.Timer, p2p_communication, parallel_state: torch.cuda.synchronize()",
        _synchronize,
    ),
    Patch(
        "torch_cuda_rng",
        "tensor_parallel.random: torch.cuda.get_rng_state / set_rng_state / manual_seed",
        _torch_cuda_rng,
    ),
    Patch("megatron_rng_helpers", "tensor_parallel.random._get/_set_cuda_rng_state", _megatron_rng_helpers),
    Patch(
        "schedules_cuda_tensors",
        "pipeline_parallel.schedules: torch.zeros(..., device='cuda')",
        _schedules_cuda_tensors,
    ),
    Patch(
        "default_causal_mask",
        "transformer.utils.get_default_causal_mask: device='cuda'",
        _default_causal_mask,
    ),
    Patch(
        "tied_embedding_sync",
        "language_module.setup_embeddings_and_output_layer: .cuda()",
        _tied_embedding_sync,
    ),
    Patch(
        "moe_router_gemm", "transformer.moe.moe_utils: te_general_gemm unbound without TE", _moe_router_gemm
    ),
)
PATCH_NAMES = tuple(p.name for p in PATCHES)

_lock = threading.Lock()
_active: dict[str, Callable[[], None]] = {}


def apply(names: tuple[str, ...] | list[str] = PATCH_NAMES) -> None:
    """Apply the named patches (idempotent); unknown names raise ``ValueError``."""
    unknown = sorted(set(names) - set(PATCH_NAMES))
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {unknown}; known: {list(PATCH_NAMES)}")
    with _lock:
        for patch in PATCHES:
            if patch.name in names and patch.name not in _active:
                _active[patch.name] = patch.install()


def remove(names: tuple[str, ...] | list[str] = PATCH_NAMES) -> None:
    """Undo the named patches that are applied (in reverse order of application)."""
    with _lock:
        for name in reversed(list(_active)):
            if name in names:
                _active.pop(name)()


def active() -> tuple[str, ...]:
    return tuple(_active)


#: the patches about Transformer Engine being absent (needed on GPU hosts without TE too)
WITHOUT_TE = ("moe_router_gemm",)


def patches_needed(cuda_available: bool, router_gemm_bound: bool) -> tuple[str, ...]:
    """Which patches this host needs: all of them without a GPU; with one, those for a missing
    Transformer Engine, unless megatron's MoE router found TE's GEMM (``router_gemm_bound``)."""
    if not cuda_available:
        return PATCH_NAMES
    return () if router_gemm_bound else WITHOUT_TE


def router_gemm_bound() -> bool:
    """Whether megatron's ``moe_utils`` bound ``te_general_gemm`` itself (it does only when TE imports;
    the ``moe_router_gemm`` patch binding it to None does not count)."""
    from megatron.core.transformer.moe import moe_utils

    return "moe_router_gemm" not in _active and hasattr(moe_utils, "te_general_gemm")


def ensure_cpu_compat() -> tuple[str, ...]:
    """Apply the patches this host needs (:func:`patches_needed`); return their names (empty on a GPU
    host with Transformer Engine)."""
    needed = patches_needed(torch.cuda.is_available(), router_gemm_bound())
    apply(needed)
    return needed
