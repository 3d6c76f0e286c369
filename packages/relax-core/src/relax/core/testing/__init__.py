"""Conformance kit: pytest base classes a backend package subclasses in its own tests.

Each class holds the contract core relies on for one seam, as ordinary ``test_*`` methods; a
subclass supplies the object under test through a small factory method and pytest runs the rest.
The classes are named ``*Conformance`` so pytest collects only your ``Test*`` subclasses. The tiny
model (two-layer Qwen3 + tokenizer, built locally once per session, no hub) comes with the kit, as
the ``model_dir`` / ``other_model_dir`` / ``tokenizer`` fixtures. Needs pytest (a test dependency).

==============================  ==========================================================
class                           you implement
==============================  ==========================================================
RolloutEngineConformance        ``make_engine(model_dir)`` [``close_engine(engine)``]
TrainerConformance              ``make_trainer(model_dir)`` [``close_trainer(trainer)``]
LogprobAgreementConformance     ``make_engine(model_dir)`` and ``make_trainer(model_dir)``
WeightSyncConformance           ``make_transport(timeout_s, bucket_bytes)`` [``make_receiver_engine``,
                                ``make_sender_trainer``, ``served_weights``, ``break_engine``,
                                ``fail_engine`` / ``heal_engine``, ``scratch_dirs``]
RewardConformance               ``make_reward()`` [``samples``, ``expected_scores``, ``slow_sample``]
EnvironmentConformance          ``make_environment()`` [``samples``, ``policy_turns``, ``expected_rewards``,
                                ``make_tokenizer``, ``close_environment``]
QueueConformance                ``make_queue(capacity, consumers)`` [``close_queue``]
ProcessorConformance            ``make_processor(model_dir)`` [``conversations``, ``expected_prompt``]
MultimodalProcessorConformance  ``media_model(root)`` and ``make_processor(model_dir)`` [``audio``,
                                ``audio_ref``]; a tiny checkpoint of your family (relax-omni's Qwen ones:
                                ``relax.omni.tiny_models.tiny_multimodal_dir(root, family)``)
==============================  ==========================================================

Example (a third-party engine package's ``tests/test_conformance.py``)::

    from relax.core.testing import LogprobAgreementConformance, RolloutEngineConformance
    from my_engine import MyEngine

    class TestMyEngine(RolloutEngineConformance):
        logprob_atol = 2e-3                       # tolerances are class attributes

        def make_engine(self, model_dir):
            return MyEngine(model_dir, dtype="float32")

    class TestMyEngineAgreesWithTorch(LogprobAgreementConformance):
        make_engine = TestMyEngine.make_engine
        def make_trainer(self, model_dir):
            from relax.core.testing import torch_trainer
            return torch_trainer(model_dir)

Helpers for an environment's own tests: ``make_turn(text, tool_calls)`` (a policy turn as core builds it),
``malformed_turn()`` (a call the parser could not read) and ``default_samples()`` (four samples with labels).

Optional capabilities (``abort``, ``save_hf``) are skipped with a reason when absent. Factories
that start Ray actors need Ray initialised first (a session fixture in your ``conftest.py``).

Under pytest, importing this package registers it for assertion rewriting before any suite module
loads, so a failing kit check shows the values it compared, as your own test files do.
"""

import pkgutil
import sys

if "pytest" in sys.modules:  # only under pytest: importing the kit never imports pytest by itself
    import pytest

    # every module of relax.core.testing (by name: the package itself is already being imported)
    pytest.register_assert_rewrite(*(f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__)))

from relax.core.testing.engine import EngineFixtures, RolloutEngineConformance, check_result
from relax.core.testing.environment import EnvironmentConformance, default_samples, make_turn, malformed_turn
from relax.core.testing.models import TinyModelFixtures, eos_token_ids, load_hf_weights, tiny_model_dir
from relax.core.testing.multimodal import MultimodalProcessorConformance
from relax.core.testing.processor import ProcessorConformance
from relax.core.testing.queue import QueueConformance
from relax.core.testing.reward import RewardConformance
from relax.core.testing.trainer import (
    LogprobAgreementConformance,
    TrainerConformance,
    TrainerFixtures,
    make_batch,
    make_samples,
    torch_trainer,
)
from relax.core.testing.transport import WeightSyncConformance

__all__ = [
    "EngineFixtures",
    "EnvironmentConformance",
    "LogprobAgreementConformance",
    "MultimodalProcessorConformance",
    "ProcessorConformance",
    "QueueConformance",
    "RewardConformance",
    "RolloutEngineConformance",
    "TinyModelFixtures",
    "TrainerConformance",
    "TrainerFixtures",
    "WeightSyncConformance",
    "check_result",
    "default_samples",
    "eos_token_ids",
    "load_hf_weights",
    "make_batch",
    "make_samples",
    "make_turn",
    "malformed_turn",
    "tiny_model_dir",
    "torch_trainer",
]
