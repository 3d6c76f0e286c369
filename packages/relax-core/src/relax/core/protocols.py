"""The plugin contract: every method core calls on every plugin kind, and nothing more.

One section per kind (rollout engine, trainer, weight sync, reward, processor,
transfer queue, model adapter), each a ``typing.Protocol``: implement the methods, inherit nothing
(where a section says a base class *is* the contract, it says so). Optional capabilities are the
``Supports*`` protocols, detected by method presence and checked at start-up
(``relax.core.controller.capabilities``). What a factory receives is documented per kind on its
``relax_register_*`` hook (``relax.core.hookspecs``); ``relax.core.testing`` holds one conformance
suite per kind that checks this contract.

Shapes follow one convention everywhere: a batch is prompts left-padded to P plus responses
right-padded to R; per-token tensors (logprobs, masks, advantages) are (B, R) over response tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate exactly max_new_tokens unless a stop id/string matches


@dataclass
class GenerationRequest:
    """One prompt to complete once (n samples per prompt = n requests)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # tokens already generated for this request (partial rollout resumes from here)
    prefix_response_ids: list[int] = field(default_factory=list)
    prefix_logprobs: list[float] = field(default_factory=list)
    prefix_versions: list[int] = field(default_factory=list)
    # processed media inputs of the prompt (``ProcessedPrompt["inputs"]``): an object-store reference or
    # the dict itself, the same object for every request of a group (resolved once by the engine)
    media: Any = None
    # a later request will continue this one's tokens (the next turn of an episode): an engine may keep
    # what it computed for them (the HF engine's prefix cache; SGLang's radix cache does so anyway)
    continues: bool = False


@dataclass
class GenerationResult:
    request_id: str
    response_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution used
    versions: list[int]  # weight version that produced each token
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""
    # MoE routing replay: (prompt + response tokens, MoE layers, top_k) expert ids, an int8/int16 numpy array
    # (relax.core.routing_replay; -1: not recorded); None unless the engine was asked to record routing
    routed_experts: Any = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Every method the controller calls on an engine. Optional capabilities are separate
    protocols below; they are detected by method presence and checked at start-up
    (``relax.core.controller.capabilities``)."""

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def weight_version(self) -> int: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def health(self) -> dict[str, Any]: ...


@runtime_checkable
class Trainer(Protocol):
    """Every method the controller calls on a trainer (policy, reference or teacher)."""

    def forward_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) log-probs of the response tokens under the current weights, no grad."""
        ...

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step (micro-batched internally) on a collated batch; returns metrics."""
        ...

    def export_weights(self, bucket_bytes: int = 64 << 20) -> Iterator[NamedTensors]:
        """HF-named tensors, grouped into buckets of roughly ``bucket_bytes``.

        A sharded trainer whose export gathers across its ranks (a collective) declares the class
        attribute ``collective_export = True``: in a worker group, every rank then iterates its own
        ``export_weights(bucket_bytes)`` in lockstep with rank 0 and only rank 0's buckets are sent
        (``relax.core.controller.collective``). Without it, only rank 0 exports."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


# ---------------------------------------------------------------- trainer backend
# A trainer backend supplies the model step only; core's loop supplies ``train_step``:
# ``PolicyUpdate(backend, UpdateSettings, objective).train_step``. The backend protocol,
# ``relax.core.policy_update.ModelStep``, lives next to the loop that calls it (not imported here: the
# contract stays on the ground floor); ``relax.core.testing.TrainerConformance`` checks it and ``Trainer``.


# ---------------------------------------------------------------- optional capabilities


@runtime_checkable
class SupportsAbort(Protocol):
    def abort(self) -> None:
        """End every in-flight request now with finish reason ``"abort"`` (they are resubmitted)."""
        ...


@runtime_checkable
class SupportsReleaseMemory(Protocol):
    """Engines that can free their accelerator memory between rollouts (``rollout.release_memory``, colocate):
    called after the step's rollout, with nothing in flight; ``resume_memory`` comes before the weight sync,
    which then writes the new weights (an engine may drop its weights on release)."""

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


@runtime_checkable
class SupportsWeightUpdateBracket(Protocol):
    """Engines that must prepare for and finish a weight update (e.g. SGLang); every transport calls
    ``begin_weight_update`` before its first bucket and ``end_weight_update`` after its last."""

    def begin_weight_update(self, version: int) -> None: ...

    def end_weight_update(self, version: int) -> None: ...


@runtime_checkable
class SupportsValues(Protocol):
    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) critic values of the response tokens (PPO, ``algorithm.critic.enable``)."""
        ...


@runtime_checkable
class SupportsSumPiSquared(Protocol):
    def forward_logprobs_and_sum_pi_squared(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_logprobs(batch)`` and, from the same forward, the (B, R) fp32 per-token sum over
        the vocabulary of squared probabilities of the same (temperature-scaled) policy, 0 where
        masked; called only when a chosen algorithm declares ``sum_pi_squared`` (optimal token
        baselines)."""
        ...


@runtime_checkable
class SupportsSaveHF(Protocol):
    def save_hf(self, directory: str) -> None:
        """Write the model in HF format (``checkpoint.save_hf_final``, ``relax convert``)."""
        ...


@runtime_checkable
class SupportsGroupScoring(Protocol):
    async def score_group(self, samples: list[Any]) -> list[float | dict[str, float]]:
        """Score all responses to one prompt at once (pairwise judges, group-relative rewards)."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """A weight-sync transport as the controller calls it (``weight_sync.transport``; built once per
    run as ``factory(params, ctx)``): the fleet calls ``sync`` (engines joining, colocate, async
    publication), start-up calls ``check_engine``, the end of the run (success or failure) ``close``.
    An object with these three methods is a transport: it may move weights any way it likes.

    Moving them *between processes* -- sending inside the trainer's process, receiving inside each
    engine's -- goes through the role actors' ``weight_sender`` / ``weight_receiver`` endpoints, which
    rebuild the transport there from its spec and call ``push`` / ``receiver``. For that side the base
    classes ``relax.core.weight_sync.Transport`` (implement ``send``) and ``Receiver`` are the
    contract: subclass them, as every built-in does; they add the begin/end bracket, a deadline on
    every call, the version check, and closing the sides they built in other processes at the end.
    """

    def sync(self, trainer: Any, engines: list[Any], version: int) -> dict[str, float]:
        """Move the trainer's weights to every engine as ``version``; return stats (seconds, bytes).

        Raises ``WeightSyncError`` naming the engine if one does not acknowledge in time.
        """
        ...

    def check_engine(self, engine: str) -> None:
        """Start-up check: raise ``WeightSyncError`` naming both if this transport cannot serve the
        registered rollout engine ``engine``."""
        ...

    def close(self) -> None:
        """The run ended (completed or failed): release what the transport holds (temporary
        directories, shared-memory segments, process groups). Called once."""
        ...


@runtime_checkable
class Reward(Protocol):
    async def score(self, sample: Any) -> float | dict[str, float]:
        """Score one sample; a dict must contain ``"score"`` (the training reward)."""
        ...


@runtime_checkable
class Processor(Protocol):
    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Turn a (multimodal) chat message list into model inputs."""
        ...


# ---------------------------------------------------------------- transfer queue

Key = tuple[int, int]  # (partition = rollout step, index within partition)
VersionSpec = int | tuple[int, int]  # one policy version, or the (min, max) a row's tokens came from


@dataclass
class Batch:
    """Rows handed to one consumer: ``data[col][i]`` belongs to ``keys[i]``."""

    keys: list[Key]
    data: dict[str, list[Any]]
    group_ids: list[Any] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (min, max) policy version per row

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def min_version(self) -> int:
        return min(v[0] for v in self.versions)

    @property
    def max_version(self) -> int:
        return max(v[1] for v in self.versions)


@runtime_checkable
class TransferQueueLike(Protocol):
    """What the async/hybrid pipeline calls on a transfer queue (``queue.name``; ``QueueConformance``).

    The factory is called as ``factory(capacity=rows, consumers=[role, ...])``: every consumer role
    is declared up front, and a row is evicted once each of them acknowledged it. Rows are keyed
    ``(partition, index)``: the pipeline's partition is the rollout step. Delivery rules: a consumer
    gets a row once the row holds every requested column; each consumer has its own cursor; rows that
    share a group id arrive together (a batch is whole groups, in arrival order); a row handed to a
    consumer is not handed to it again. Core never checkpoints a queue: a resumed run draws the steps
    it had not trained again. The concrete ``relax.core.queue.TransferQueue`` offers more
    (``group_size`` for groups put over several calls, ``release``, leases, ``state_dict``), which core
    does not call.
    """

    def put_rows(
        self,
        partition: int,
        rows: Sequence[dict[str, Any]],
        group_ids: Sequence[Any] | None = None,
        version: VersionSpec | list[VersionSpec] = 0,
        timeout: float | None = None,
    ) -> list[Key]:
        """Append rows (column name -> value) to ``partition``; one version per row or one for all.
        Blocks while the queue holds ``capacity`` rows; ``TimeoutError`` after ``timeout`` seconds;
        ``ValueError`` for more rows than ``capacity``. Returns the new rows' keys, indices counting
        up per partition from 0."""
        ...

    def get(
        self,
        consumer: str,
        columns: Sequence[str],
        batch_size: int,
        timeout: float | None,
        partition: int | None = None,
    ) -> Batch:
        """``batch_size`` rows (whole groups) that hold every one of ``columns``, only those columns;
        ``partition`` restricts them to one rollout step. ``TimeoutError`` after ``timeout`` seconds."""
        ...

    def add_columns(self, keys: Sequence[Key], columns: dict[str, Sequence[Any]]) -> None:
        """Set columns (reward, reference logprobs, advantages) on rows already in the queue."""
        ...

    def ack(self, consumer: str, keys: Iterable[Key]) -> None:
        """``consumer`` is done with these rows (idempotent); they count towards eviction."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat numbers logged every step: at least ``queue/rows`` and ``queue/capacity``; counters
        named ``queue/rows_produced`` and ``queue/rows_consumed/<consumer>`` also give per-second rates."""
        ...

    def close(self) -> None:
        """Called once when the pipeline stops (end of run, failure, recovery): release what the queue
        holds (an actor, a server); rows still held are dropped."""
        ...


# ---------------------------------------------------------------- model adapters
@runtime_checkable
class ModelAdapter(Protocol):
    """How core loads and feeds one HF model family, registered per ``config.model_type`` through
    ``relax_register_model_adapters``. A plain causal LM needs none (core loads it with
    ``AutoModelForCausalLM``); a model that takes media does, so that core stays free of family code.
    The trainer and the HF engine call the same methods, so rollout and training see one model."""

    #: weight-name prefixes of the media encoders by kind (``"vision"``, ``"audio"``, ...): a kind is frozen
    #: by ``trainer.backend_params.freeze_<kind>`` (every kind by ``freeze_media_towers``), then left out
    #: of weight syncs and exports
    tower_kinds: dict[str, tuple[str, ...]]
    #: processed-input keys that are per-prompt flags for the forward (not media tensors); engines that
    #: cannot honour them refuse the prompt naming the key
    media_flags: tuple[str, ...]

    def load(self, model_path: str, dtype: torch.dtype) -> Any:
        """The model for training and rollout, with any patch it needs applied."""
        ...

    def loaded_config(self, config: Any) -> Any:
        """The HF config of the model :meth:`load` returns, from the checkpoint's (e.g. the thinker's of a
        whole Qwen-Omni checkpoint). Optional: core uses the checkpoint's config where an adapter has none."""
        ...

    def restore_layout(self, directory: str, model_path: str) -> bool:
        """Write ``directory`` (the loaded model, saved by ``save_hf`` or ``relax convert``) back into the layout of
        the checkpoint at ``model_path`` where :meth:`load` took only part of it (a whole Qwen-Omni's thinker);
        False when there is nothing to do. Optional."""
        ...

    def media_token_ids(self, config: Any) -> list[int]:
        """Placeholder and start/end token ids of every media kind (a response never adds media)."""
        ...

    def forward_kwargs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        media: dict[str, torch.Tensor],
        prompt_width: int,
        observed: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Forward keywords (``input_ids`` included) that make ``model`` see ``media`` (one prompt's
        processed inputs per row, ``source.*`` entries included) for prompt + response ``input_ids``.
        Media ids the response *sampled* are fed as token 0 (a policy never adds media); ``observed`` (B, R
        bool, multi-turn only, passed only when some row has one) marks response positions that are
        observations, whose media ids are real placeholders of media appended to ``media``."""
        ...

    def rope_positions(self, model: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The (k, B, L) rotary positions ``model`` computes itself for ``forward_kwargs``'s padded rows (None:
        plain 1-D positions), so a caller can lay the rows out anew: packed without padding (core's
        ``trainers.packing``), or a megatron stage. Optional (absent: such rows are not packed)."""
        ...

    def before_prefill(self, model: Any) -> None:
        """Clear what an earlier forward left on ``model`` that the next prefill must compute afresh."""
        ...

    def decode_positions(self, model: Any, rows: int) -> Any:
        """Called right after a media prefill of ``rows`` rows: ``positions(length) -> position_ids`` for
        the decode step that feeds each row's token at cache position ``length``."""
        ...

    # What the backends read (``relax.core.model_family``; each optional). A text-only family registers an
    # adapter with ``takes_media = False`` and only these: core's HF path then loads it as a plain causal LM.
    #: False: core's HF trainer and engine ignore the adapter (a text-only family, declared for the backends)
    takes_media: bool

    def megatron_layout(self, hf_config: Any) -> Any:
        """``model_family.MegatronLayout`` of an HF language-model config of this family: shapes, attention /
        rotary / router kinds and the weights the HF <-> megatron mapping fuses (relax-megatron). Optional."""
        ...

    def megatron_media(self, model_type: str) -> Any:
        """``model_family.MediaTowerHooks`` of a media model type relax-megatron runs (None: refused by name),
        and ``megatron_lm_config(hf_config)`` its language model's HF config. Optional."""
        ...

    def serving(self, model_type: str) -> Any:
        """``model_family.ServingConventions``: media config key, audio sample rate, video frame layout and the
        served checkpoint's names (relax-sglang). Optional."""
        ...

    def moe_routing(self, hf_config: Any) -> Any:
        """``model_family.MoeRouting``: which decoder layers route and how the router weights its experts (the
        engines' recorded routing, the torch trainers' replay); None or absent: a softmax router in every MoE
        layer, as the config's Qwen-style fields say. Optional."""
        ...


# ---------------------------------------------------------------- environments (multi-turn rollouts)
# ``environment.name`` selects one (``relax_register_environments``); without one every rollout is a
# single completion. With one, core runs each sample as an episode (``relax.core.agentic``): the
# engine samples a turn, the tool parser (``environment.tool_parser``) finds its tool calls, the
# episode answers with observation messages, whose tokens core appends (rendered by the chat template
# as a continuation, loss mask 0), and the engine continues from the exact token prefix.


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    #: non-empty when the call was malformed (unparseable JSON, no name): ``raw`` is what the policy wrote
    error: str = ""
    raw: str = ""


@dataclass
class Turn:
    """One policy turn, as an episode sees it: the sampled tokens, their text, the parsed calls."""

    index: int  # 0-based
    text: str  # decoded, with the tool-call markup still in it
    token_ids: list[int]
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length"
    content: str = ""  # ``text`` without the tool-call markup
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per ``token_ids``


@dataclass
class StepResult:
    """An episode's answer to a turn. ``observations`` are chat messages (``role`` ``"tool"`` or
    ``"user"``; ``content`` text, or a list of parts for media: ``{"type": "image", "image": ...}``)."""

    observations: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    #: the episode's reward, when it knows one (read by the built-in ``environment`` reward)
    reward: float | None = None
    #: numbers counted into the step's metrics as ``episode/<key>`` (tool calls, tool errors, ...)
    info: dict[str, float] = field(default_factory=dict)
    #: the environment's own failures in this step (a tool that raised or hung), one reason each: the episode
    #: goes on, and core reports them as kind ``tool`` (console, ``failures.jsonl``, the run's end summary)
    failures: list[str] = field(default_factory=list)


@runtime_checkable
class Episode(Protocol):
    """One rollout's conversation with its environment. Called from a worker thread, one call at a
    time, each bounded by ``environment.turn_timeout_s``: a call that overruns ends the episode, and
    its thread gets ``EpisodeTimeout`` raised in it (Python code stops at its next bytecode; a call
    blocked in C -- a socket read, a subprocess wait -- stops when it returns: bound those yourself)."""

    def step(self, turn: Turn) -> StepResult: ...

    def close(self) -> None:
        """The episode ended (done, a limit, a timeout or an error): release what it holds."""
        ...


@runtime_checkable
class Environment(Protocol):
    """May also have ``close()``: called once when the run ends (its servers, tool processes)."""

    def start(self, sample: Any) -> Episode:
        """An episode for one sample (``relax.core.data.Sample``: its ``prompt_text``, ``label`` and
        ``metadata`` come from the dataset row); read-only."""
        ...


@runtime_checkable
class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(text without the tool-call markup, the calls in order); a malformed call is a
        ``ToolCall`` with ``error`` set, never an exception."""
        ...
