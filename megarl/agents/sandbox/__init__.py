"""The Python code tool's sandbox: the bubblewrap command line (bwrap.py), its seccomp filter (seccomp.py) and the
supervisor that runs inside it as PID 1 (supervisor.py). megarl/agents/code_tool.py runs code through them."""
