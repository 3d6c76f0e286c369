"""relax-omni plugin: registers the Qwen-VL / Qwen-Omni (thinker) processors (``data.processor: <family>``)."""

from relax.core.hookspecs import hookimpl
from relax.omni.processors import FAMILIES, OmniProcessorParams, make_factory


@hookimpl
def relax_register_processors(register):
    for family in FAMILIES:
        register(family, make_factory(family), config=OmniProcessorParams)
