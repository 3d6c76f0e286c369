"""relax-omni plugin: registers the Qwen-VL / Qwen-Omni (thinker) processors (``data.processor: <family>``),
the model adapters through which core's trainer and HF engine run those models, and the omni quick-starts'
inputs (``inputs.name: omni_vl_quickstart | omni_audio_quickstart``: a tiny model and media task built on first use),
and the media recipes with their datasets (``relax.omni.recipes``)."""

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


@hookimpl
def relax_register_inputs(register):
    from relax.omni.quickstart import register_inputs
    from relax.omni.recipes import register_inputs as register_smoke_inputs

    register_inputs(register)
    register_smoke_inputs(register)  # the media recipes' CPU smoke variants


# the media recipes (Open-R1 VL, AVQA Omni) and their datasets (relax.omni.recipes)
@hookimpl
def relax_register_datasets(register):
    from relax.omni.recipes import register_datasets

    register_datasets(register)


@hookimpl
def relax_register_recipes(register):
    from relax.omni.recipes import register_recipes

    register_recipes(register)
