"""Tools for agents: the sandbox that runs model-written code (`opd.tools.sandbox`)."""
