"""The exceptions users see. Every error the runtime raises on bad input derives from
`NanoqwenError`, so the CLI and the server can turn it into a clear message instead of a
traceback."""


class NanoqwenError(Exception):
    """Base class of every user-facing nanoqwen error."""


class FormatError(NanoqwenError):
    """A .nanoqwen file that cannot be read: bad magic, version, layout, bounds, checksum."""


class ConvertError(NanoqwenError):
    """A source checkpoint (HF directory, GGUF file) that cannot be packed."""


class ContextError(NanoqwenError):
    """A request that does not fit the model: prompt + max_tokens beyond the context, an
    empty prompt, a token id outside the vocabulary, a context size out of range."""


class TokenizerError(NanoqwenError):
    """A missing or unusable tokenizer, or input it cannot encode."""


class ToolsError(TokenizerError):
    """Tool definitions the chat template cannot take (or a template without tool support)."""


class DeviceError(NanoqwenError):
    """A CUDA failure; after a sticky error the engine refuses further work."""
