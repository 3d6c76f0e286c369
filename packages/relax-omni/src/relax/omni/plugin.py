"""relax-omni plugin: registers the Qwen-VL / Qwen-Omni (thinker) processors (``data.processor: <family>``)
and the model adapters through which core's trainer and HF engine run those models."""

from relax.core.hookspecs import hookimpl
from relax.omni.processors import FAMILIES, OmniProcessorParams, make_factory


@hookimpl
def relax_register_processors(register):
    for family in FAMILIES:
        register(family, make_factory(family), config=OmniProcessorParams)


@hookimpl
def relax_register_model_adapters(register):
    from relax.omni.adapters import register_adapters

    register_adapters(register)
