"""Named request errors: sampling parameters refused where they are built, and what the engine refuses at
`add_request`; nothing is queued when they fire. Each survives pickling with its fields (a node's refusal
reaches the gateway pickled, over its link or through Ray), which an exception whose constructor takes
other arguments than its message does not without `__reduce__`."""


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `.param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message

    def __reduce__(self):
        return InvalidSamplingParams, (self.param, self.message)


class EngineError(Exception):
    """Base of errors about a request the engine refuses."""


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_model_len: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {prompt_tokens} tokens (at least one more is needed to generate)."
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len

    def __reduce__(self):
        return PromptTooLong, (self.prompt_tokens, self.max_model_len)


class InvalidPrompt(EngineError):
    """Empty prompt, or token ids outside the vocabulary."""


class DuplicateRequest(EngineError):
    """A request id that is already in the engine."""


class UnknownRequest(EngineError):
    """A request id the engine does not hold."""
