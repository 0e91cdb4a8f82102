"""Shared by the `opd check` groups' tests (tests/check/): the chat both the tokenizer and the scoring rows render."""

MESSAGES = [{"role": "user", "content": "Compute (3+4)*2. Put the final answer in \\boxed{}."}]
