"""The built-in text processor passes the processor suite."""

from transformers import AutoTokenizer

from relax.core.processors import TextProcessor
from relax.core.testing.processor import ProcessorConformance


class TestTextProcessorConformance(ProcessorConformance):
    def make_processor(self, model_dir):
        return TextProcessor(AutoTokenizer.from_pretrained(model_dir))
