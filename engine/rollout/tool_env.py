"""A tool-using environment for multi-turn RL (``rl.environment``): the policy calls tools in
its own chat template's format, the tools run, and their results come back as the template's
tool turn (``data.tool_calls``).

Per policy turn (``step``):

- the turn's text is parsed for calls (:meth:`data.tool_calls.ToolCallFormat.parse`);
- a turn without calls is the final answer: the episode ends, scored by the verifier
  (``data.rewards.VERIFIERS``) against the row's label;
- otherwise each call (at most ``max_calls_per_turn``) runs: a tool is a plug-in callable
  taking the call's arguments as keywords and returning a string (anything else is
  ``str()``-ed); an unknown tool, one the row does not offer (its ``tools`` schema), malformed
  JSON, an exception and a call over ``tool_timeout_s`` seconds each answer with an
  ``error: ...`` result instead, so the policy sees its mistake and the run goes on;
- the observation is :func:`data.tool_calls.tool_observation` of the results: the text the
  template writes after the calling turn's end up to the next assistant header. The multi-turn
  loop appends it as tokens after the sampled ones, so the ids trained are exactly the ids
  sampled plus the observation ids (nothing earlier is re-rendered or re-tokenized).

Rewards: 0 for a tool turn, the verifier's score for the final answer (the sample's reward is
their sum, ``engine.rollout.multi_turn``). A timed-out tool keeps running on its thread until it
returns (Python cannot stop a thread); give slow tools their own timeout, or run them out of
process (the code sandbox, ``data.sandbox``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from data.tool_calls import MalformedCall, tool_call_format, tool_observation
from engine.rollout.multi_turn import StepResult


class ToolEnvironment:
    """The environment of the module docstring; one instance per sample.

    Args:
        tools: tool name -> callable (``fn(**arguments) -> str``).
        tokenizer: the policy's tokenizer (its chat template gives the call format and the
            observation's text). ``engine.rollout.multi_turn`` passes it to a factory that takes
            a ``tokenizer`` argument.
        verifier: ``data.rewards.VERIFIERS`` name scoring the final answer against the row's label.
        tool_timeout_s: seconds a call may take before it answers ``error: ... timed out``.
        max_calls_per_turn: calls run per turn; later ones answer ``error: too many calls``.

    Raises:
        ChatTemplateError: the tokenizer's template does not render tool calls (names the model).
        ValueError: an unknown verifier.
    """

    def __init__(
        self,
        tools: Mapping[str, Callable[..., Any]],
        tokenizer,
        verifier: str = "exact_match",
        tool_timeout_s: float = 10.0,
        max_calls_per_turn: int = 4,
    ):
        # polars (via data.rewards): ~0.5 s to import, not paid until this runs
        from data.rewards import get_verifier

        self.tools = dict(tools)
        self.tokenizer = tokenizer
        self.format = tool_call_format(tokenizer)
        self.score = get_verifier(verifier)
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_calls_per_turn = int(max_calls_per_turn)
        self.label: str = ""
        self.offered: set[str] = set(self.tools)
        self.calls: list[tuple[str, dict, str]] = []  # (tool, arguments, result) of every call, in order

    def reset(self, prompt_row: dict[str, Any]) -> None:
        """Start an episode: the row's label, and the tools it offers (the names in its
        ``tools`` schema, OpenAI's ``{"type": "function", "function": {"name": ...}}`` or a bare
        ``{"name": ...}``; all of ``tools`` when the row has none)."""
        self.label = str(prompt_row.get("label", ""))
        schema = prompt_row.get("tools")
        if schema:
            self.offered = {str((t.get("function") or t).get("name")) for t in schema if isinstance(t, dict)}
        else:
            self.offered = set(self.tools)
        self.calls = []

    def step(self, response_text: str) -> StepResult:
        """Run the turn's calls and answer with their results, or score a final answer."""
        calls = self.format.parse(response_text)
        if not calls:
            return StepResult("", float(self.score(response_text, self.label, "stop")), done=True)
        results = []
        for i, call in enumerate(calls):
            if i >= self.max_calls_per_turn:
                results.append(f"error: too many calls in one turn (at most {self.max_calls_per_turn})")
            elif isinstance(call, MalformedCall):
                results.append(f"error: malformed tool call: {call.reason}")
            else:
                results.append(self._run(call.name, call.arguments))
        return StepResult(tool_observation(self.tokenizer, results), 0.0, done=False)

    def _run(self, name: str, arguments: dict) -> str:
        if name not in self.tools or name not in self.offered:
            result = f"error: unknown tool {name!r} (available: {', '.join(sorted(self.offered & set(self.tools)))})"
        else:
            pool = ThreadPoolExecutor(1, thread_name_prefix=f"tool-{name}")
            try:
                result = str(pool.submit(self.tools[name], **arguments).result(timeout=self.tool_timeout_s))
            except FutureTimeout:
                result = f"error: tool {name!r} timed out after {self.tool_timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the policy's observation
                result = f"error: {type(exc).__name__}: {exc}"
            finally:
                pool.shutdown(wait=False)
        self.calls.append((name, arguments, result))
        return result
