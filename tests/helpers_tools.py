"""Helpers of the tools suite (tests/tools/): the tiny tokenizer of `helpers` with Qwen2.5-Instruct's chat template,
whose tool blocks (the `# Tools` system prompt, `<tool_call>` JSON, `<tool_response>` inside a user turn) are what
`opd.tools.calls` must render and parse."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from helpers import make_tiny_tokenizer

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
