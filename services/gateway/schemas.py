"""Request bodies of the OpenAI-compatible and admin APIs, validated by pydantic.

A field is supported when it is declared here: any other is a 400 naming it (the app turns
pydantic's `extra_forbidden` into "Unsupported parameter"), so a client never gets a 200 that
silently ignored what it asked for. Exceptions, in one place below: fields that change nothing
this gateway could do, and any field sent as null (OpenAI's "not given"). Values out of range
are a 400 naming the parameter."""

from abc import abstractmethod
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from libs.planning.autoscale import check_policy
from libs.planning.scaleout import deploy_policy
from libs.protocol import messages as m


# Accepted and ignored whatever their value: they ask for nothing a client could see differ here
# (ids and tags for OpenAI's abuse monitoring and dashboards, caching and service-tier hints;
# padding of streamed chunks).
IGNORED_FIELDS = frozenset({
    "user", "safety_identifier", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "include_obfuscation"})
# Accepted at these values only, which ask for what layercast does anyway (it never stores outputs).
NEUTRAL_VALUES: dict[str, Any] = {"store": False}


class _Body(BaseModel):
    # Finite numbers only: 1e999 is a JSON number that parses as inf, which no field means.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k in cls.model_fields or not _ignored(k, v)}


def _ignored(name: str, value: Any) -> bool:
    neutral = NEUTRAL_VALUES.get(name, ...)
    return value is None or name in IGNORED_FIELDS or (type(value) is type(neutral) and value == neutral)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema (constrained decoding)


class ResponseFormat(_Body):
    """`text`, `json_object` (any JSON object) or `json_schema` (JSON valid against its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class _SamplingBody(_Body, m.SamplingParameters):
    """A generation request: the sampling parameters as the protocol declares them (m.SamplingParameters:
    their ranges are checked there, once), and what the gateway resolves before sending it on."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # on completions too, as vLLM has it

    @model_validator(mode="before")
    @classmethod
    def _null_sampling_is_default(cls, data: Any) -> Any:
        # A sampling parameter sent as null is not given (OpenAI's clients send null for unset).
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in m.SamplingParameters.model_fields}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def asked_max_tokens(self) -> tuple[int | None, str]:
        """The completion length asked for (None: as much as fits, up to the gateway's default), and
        the parameter that asked it."""
        return self.max_tokens, "max_tokens"

    @abstractmethod
    def asked_logprobs(self) -> int | None:
        """The top logprobs per token asked for (0: the sampled token's only); None: no logprobs."""

    def to_sampling_spec(self, max_tokens: int, stop_token_ids: list[int], grammar: str | None) -> m.SamplingSpec:
        """The request's sampling as a worker's engine runs it (vLLM's `to_sampling_params`): the
        parameters as given, with what the gateway resolved: `max_tokens` fitted to the context,
        the model's end-of-sequence ids and the grammar of response_format or tools."""
        return m.SamplingSpec(**self.model_dump(include=set(m.SamplingParameters.model_fields)),
                              max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                              logprobs=self.asked_logprobs(), grammar=grammar)


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's: the top k, 0..5

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # echo + logprobs asks for the prompt's logprobs too: the engine computes the generated
        # tokens' only, so a partial answer would mislead (e.g. a scoring harness).
        if v is not None and info.data.get("echo"):
            raise ValueError("echo with logprobs (the prompt's logprobs) is not supported")
        return v

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int]) -> str | list[int]:
        if isinstance(v, list):
            if len(v) == 0:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported (n completions of it: use n)")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API returns it


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # a required or named call always follows its schema


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # "required" and a named tool make exactly one call; "auto" returns every call the model
    # writes, or only the first with parallel_tool_calls false.
    parallel_tool_calls: bool | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v, info: ValidationInfo):
        if v is not None and v != "none" and not info.data.get("tools"):
            raise ValueError("tool_choice needs tools")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    def asked_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a prompt, or chat messages rendered by the model's chat template."""

    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default as the completion endpoints do: a prompt's yes, chat's no

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Body):
    model: str = Field(min_length=1)
    tokens: list[int]


# Bounds of a deployment's durations, well past any meaningful one (1e308 s was accepted): never
# scaling to zero is min_instances >= 1, not a keep-alive of centuries.
MAX_KEEP_ALIVE_S = 30 * 86400.0
MAX_SLO_S = 3600.0


class DeployRequest(_Body):
    name: m.ModelName
    path: str = Field(min_length=1)
    min_instances: int = Field(default=0, ge=0, le=m.INT32_MAX)
    max_instances: int = Field(default=4, ge=1, le=m.INT32_MAX)
    keep_alive_s: float = Field(default=60.0, ge=0, le=MAX_KEEP_ALIVE_S)
    max_queue: int = Field(default=256, ge=1, le=m.INT32_MAX)
    scaling_mode: m.ScalingMode = "layercast"
    # None (not given): the scaling mode's default (libs.planning.scaleout.deploy_policy):
    # threshold for blitzscale, concurrency otherwise.
    policy: m.ScalingPolicy = "concurrency"
    policy_params: dict[str, float] = Field(default_factory=dict, validate_default=True)
    # LLM-Mesh SLOs (m.DeployModel): None = max(2, prompt tokens / 512) s.
    ttft_slo_s: float | None = Field(default=None, gt=0, le=MAX_SLO_S)
    tpot_slo_s: float = Field(default=0.25, gt=0, le=MAX_SLO_S)

    @model_validator(mode="before")
    @classmethod
    def _mode_policy(cls, data: Any) -> Any:
        # A deployment that names no policy gets its scaling mode's (before the parameters are checked).
        if isinstance(data, dict) and data.get("policy") is None and isinstance(data.get("scaling_mode"), str):
            try:
                policy, params = deploy_policy(data["scaling_mode"], None, data.get("policy_params") or {})
            except (ValueError, TypeError):
                return data  # an unknown mode or bad parameters: the field checks say so
            data = {**data, "policy": policy, "policy_params": params}
        return data

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if "\x00" in v:  # no file system path holds one: the OS would refuse it (a 500, unchecked)
            raise ValueError("a path must not contain a NUL character")
        return v

    @field_validator("policy_params")
    @classmethod
    def _policy_params(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        # Checked here so a bad parameter is a 400 naming policy_params, as the registry would refuse it.
        fields = ("policy", "min_instances", "max_instances", "keep_alive_s")
        if all(f in info.data for f in fields):
            check_policy(info.data["policy"], v, min_instances=info.data["min_instances"],
                         max_instances=info.data["max_instances"], keep_alive_s=info.data["keep_alive_s"])
        return v


class ProfileRequest(_Body):
    """A measured LLM-Mesh profile to store (m.ModelProfile; `layercast model profile --publish`)."""

    model: m.ModelName
    device: Literal["cpu", "cuda"]
    prefill_lengths: list[int] = Field(min_length=1)
    prefill_s: list[float] = Field(min_length=1)
    batches: list[int] = Field(min_length=1)
    lengths: list[int] = Field(min_length=1)
    decode_s: list[list[float]] = Field(min_length=1)
    measured_at: float | None = None  # None: now
    source: str = Field(default="", max_length=256)


class KeyRequest(_Body):
    """A new API key: the models it may use (none given: every model) and its limits (none: unlimited)."""

    name: m.KeyName
    models: list[str] | None = Field(default=None, min_length=1)
    requests_per_minute: m.PerMinuteLimit | None = None
    tokens_per_minute: m.PerMinuteLimit | None = None
