"""Grammar constraints (structured output, tool calls) compiled with llguidance, applied per verify row.

:class:`Constraint` is compiled once per request; :meth:`Constraint.start` gives a generation's
:class:`GrammarState`, the per-row logits mask the token chooser applies. The grammar drafter
(:mod:`redraft.drafters.grammar`) proposes the tokens a state forces.
"""

from redraft.grammar.constraint import JSON_OPTIONS, Constraint, grammar_tokenizer, json_rule
from redraft.grammar.errors import GrammarError
from redraft.grammar.state import GrammarState

__all__ = ["JSON_OPTIONS", "Constraint", "GrammarError", "GrammarState", "grammar_tokenizer", "json_rule"]
