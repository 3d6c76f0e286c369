"""relax-models plugin: registers the text-LM families' model adapters (``relax_register_model_adapters``)."""

from relax.core.hookspecs import hookimpl


@hookimpl
def relax_register_model_adapters(register):
    from relax.models.families import register_adapters

    register_adapters(register)
