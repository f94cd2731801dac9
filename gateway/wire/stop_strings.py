"""Stop strings where the whole output is constrained: refused, never a cut answer.

A stop string is matched on the generated text after sampling (``IncrementalDetokenizer``),
whatever a grammar allows, as vLLM does: under a constraint on the whole output (a JSON
schema, ``json_object``, a regex, a choice, an EBNF grammar, a forced tool call) a stop
string the constrained text happens to contain (``"{"``, ``"\\n"``, a quote) ends the answer
inside it — a tool call with arguments ``"{"`` or a JSON body that does not parse, sent with
finish reason ``"stop"`` as if complete. No finish reason of the OpenAI or Anthropic APIs
says "cut by a stop string inside the constraint", so the gateway refuses the combination
before any work: 400 naming the stop field (``stop``; ``stop_sequences`` on ``/v1/messages``),
in both modes. The constraint ends the answer itself (the grammar's end), so a stop string
adds nothing a client can rely on.

Not refused: ``stop_token_ids`` (the engine treats them as ends, allowed only where the
grammar may end: ``engine/logits_processors.py``), and ``tool_choice: "auto"`` with strict
tools (the constraint covers only the call after free text; a stop string cutting the call
leaves text the parser does not return as a call). ``/v1/responses`` has no stop field.
"""

from __future__ import annotations

from typing import Any

from prefixgate.gateway.http.errors import bad_request

# vLLM's older spellings of a constraint (each constrains the whole output)
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def refuse_stop_under_constraint(stop: Any, stop_param: str, constraint: str | None) -> None:
    """Refuse stop strings (``stop``: a string or a list of them) when the whole output is
    constrained by the request field ``constraint`` (None: unconstrained, nothing refused).
    An empty string or list asks for nothing and passes.

    Raises:
        APIError: 400 ``invalid_request_error`` naming ``stop_param``.
    """
    if constraint is None or not stop:
        return
    raise bad_request(
        f"{stop_param}: cannot be combined with {constraint} (it constrains the whole output; "
        "a stop string matched inside the constrained text would cut it, and the answer "
        f"would not be a complete tool call or valid output): drop {stop_param}, the "
        "constraint ends the answer itself",
        param=stop_param,
    )


def openai_constraint(body: dict[str, Any]) -> str | None:
    """The field of a raw chat / completions body (proxy mode: not parsed by the request
    models) that constrains the whole output, or None: ``response_format`` of type
    ``json_object`` / ``json_schema``, ``structured_outputs``, a ``guided_*`` field, or a
    ``tool_choice`` of ``"required"`` or a named function."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return "response_format"
    for name in ("structured_outputs", *_GUIDED):
        if body.get(name) is not None:
            return name
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    return None


def anthropic_constraint(body: dict[str, Any]) -> str | None:
    """``"tool_choice"`` when a raw Messages body forces a tool call (``{"type": "any"}`` or
    ``{"type": "tool", "name": ...}``), ``"output_config.format"`` / ``"output_format"`` when
    it asks for structured output, else None."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        return "tool_choice"
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("format"):
        return "output_config.format"
    if body.get("output_format"):
        return "output_format"
    return None
