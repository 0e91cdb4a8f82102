"""Tools for agents: the sandbox that runs model-written code (`opd.tools.sandbox`), the environment protocol, its
built-ins and registry (`opd.tools.environments`), and tool calls in the model's own chat format
(`opd.tools.calls`)."""
