"""Render a model's Hugging Face chat template exactly as transformers does, without importing transformers.

A template is code from the Hub, so it runs in jinja2's sandbox with every render bounded (output and every string
at ``max_chars``, lists at 200,000 items, 2M template lines, 10 s, a memory cap, the caller's cancel event); each
call ends well under a second, and every failure is a one-line ``ChatTemplateError`` or ``ConfigError``.

Parts, top to bottom (each imports only those below it):

* ``template.py``: ``ChatTemplate``: compile once, ``render`` (variables, the budget, errors, continue_final_message).
* ``model_dir.py``: the template and special tokens of a model folder, found as ``AutoTokenizer`` finds them.
* ``inputs.py``: messages, tools and documents rebuilt as plain JSON; the reasoning aliases filled.
* ``sandbox.py``: the Jinja environment (transformers' configuration), its hooks and globals, the shared ``_ENV``.
* ``checks.py``: operators, str methods, calls and every filter, bounded before they run.
* ``measure.py``: sizes of values (their text, JSON, pprint, format results) known before they are built.
* ``limits.py``: the caps, a render's ``_Budget`` (line counting) and the watchdog thread (deadline, memory, cancel).
"""

from .template import ChatTemplate

__all__ = ["ChatTemplate"]
