"""``openai_agent`` passes core's ``EnvironmentConformance`` with a plain OpenAI-client agent."""

from __future__ import annotations

from relax.agents.openai_env import OpenAIAgentEnvironment, OpenAIAgentParams
from relax.core.data import Sample
from relax.core.quickstart_model import build_tokenizer
from relax.core.testing.environment import EnvironmentConformance

CASES = (("6*7=", "42"), ("12+30=", "42"), ("9-4=", "5"), ("7", "7"))


def answer_checking_agent(client, row):
    """Asks until a reply holds the label (at most 3 times); reward 1 when one did."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="relax", messages=messages)
        message = reply.choices[0].message
        if row["label"] in (message.content or ""):
            return 1.0
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
    return 0.0


class TestOpenAIAgentConformance(EnvironmentConformance):
    step_budget_s = 10.0

    def make_environment(self):
        params = OpenAIAgentParams(call_timeout_s=self.step_budget_s)
        return OpenAIAgentEnvironment(params, build_tokenizer(), agent=answer_checking_agent)

    def samples(self):
        tokenizer = build_tokenizer()
        out = []
        for i, (prompt, label) in enumerate(CASES):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            out.append(
                Sample(prompt_ids=ids, group_id=i, prompt_text=text, label=label, metadata={"prompt": prompt})
            )
        return out

    def expected_rewards(self):
        return [1.0] * len(CASES)  # the second default turn says "The answer is <label>."
