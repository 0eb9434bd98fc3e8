"""A character-level pushdown automaton that recognizes prefixes of one JSON value (RFC 8259).

States are small immutable tuples ``(mode, stack, aux)`` (``stack`` is a string of open ``{``/``[``),
so steps are memoized. The tool-call parsers use it to stream function-call arguments only while
they are still a valid JSON prefix (constraining the output itself is the grammar engine's job, see
``structured.py``). :func:`step` returns ``None`` for a character that can never continue a valid
JSON text.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["State", "initial", "is_complete", "step"]

State = tuple  # (mode, stack, aux)

# modes
_VALUE, _STR, _ESC, _UNI, _NUM, _LIT, _AFTER, _OBJ_FIRST, _OBJ_KEY, _COLON = range(10)
# _VALUE aux: 0 any value, 1 any value or "]" (right after "["), 2 only an object (top level of JSON mode)
_WS = " \t\n\r"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NUM_END_OK = {"zero", "int", "frac", "exp"}  # phases in which a number may end


def initial(top_object: bool = False) -> State:
    """The start state: any JSON value, or only an object when ``top_object`` (OpenAI JSON mode)."""
    return (_VALUE, "", 2 if top_object else 0)


def _after(stack: str) -> State:
    return (_AFTER, stack, 0)


def _value_start(stack: str, ch: str) -> State | None:
    if ch == "{":
        return (_OBJ_FIRST, stack + "{", 0)
    if ch == "[":
        return (_VALUE, stack + "[", 1)
    if ch == '"':
        return (_STR, stack, 0)
    if ch == "-":
        return (_NUM, stack, "minus")
    if ch == "0":
        return (_NUM, stack, "zero")
    if "1" <= ch <= "9":
        return (_NUM, stack, "int")
    word = _LITERALS.get(ch)
    if word is not None:
        return (_LIT, stack, (word, 1))
    return None


def _close(stack: str, ch: str) -> State | None:
    if stack and ((ch == "}" and stack[-1] == "{") or (ch == "]" and stack[-1] == "[")):
        return _after(stack[:-1])
    return None


@lru_cache(maxsize=1 << 16)
def step(state: State, ch: str) -> State | None:
    """The state after reading one character ``ch``, or ``None`` when the text stops being a JSON prefix."""
    mode, stack, aux = state
    if mode == _VALUE:
        if ch in _WS:
            return state
        if aux == 1 and ch == "]":
            return _after(stack[:-1])
        if aux == 2 and ch != "{":
            return None
        return _value_start(stack, ch)
    if mode == _STR:
        if ch == '"':
            return (_COLON, stack, 0) if aux else _after(stack)
        if ch == "\\":
            return (_ESC, stack, aux)
        return None if ch < " " else state
    if mode == _ESC:
        if ch in '"\\/bfnrt':
            return (_STR, stack, aux)
        if ch == "u":
            return (_UNI, stack, (aux, 4))
        return None
    if mode == _UNI:
        key, left = aux
        if ch not in "0123456789abcdefABCDEF":
            return None
        return (_STR, stack, key) if left == 1 else (_UNI, stack, (key, left - 1))
    if mode == _NUM:
        phase = aux
        digit = "0" <= ch <= "9"
        nxt = None
        if phase == "minus":
            nxt = "zero" if ch == "0" else "int" if digit else None
            return None if nxt is None else (_NUM, stack, nxt)
        if phase in ("zero", "int") and ch == ".":
            return (_NUM, stack, "dot")
        if phase in ("zero", "int", "frac") and ch in "eE":
            return (_NUM, stack, "e")
        if phase == "int" and digit:
            return state
        if phase in ("dot", "frac") and digit:
            return (_NUM, stack, "frac")
        if phase == "e" and ch in "+-":
            return (_NUM, stack, "esign")
        if phase in ("e", "esign", "exp") and digit:
            return (_NUM, stack, "exp")
        if phase in _NUM_END_OK:  # the number ended: this character belongs to what follows
            return step(_after(stack), ch)
        return None
    if mode == _LIT:
        word, pos = aux
        if ch != word[pos]:
            return None
        return _after(stack) if pos + 1 == len(word) else (_LIT, stack, (word, pos + 1))
    if mode == _AFTER:
        if ch in _WS:
            return state
        if not stack:
            return None
        if ch == ",":
            return (_OBJ_KEY, stack, 0) if stack[-1] == "{" else (_VALUE, stack, 0)
        return _close(stack, ch)
    if mode == _OBJ_FIRST:
        if ch in _WS:
            return state
        if ch == '"':
            return (_STR, stack, 1)
        return _close(stack, ch)
    if mode == _OBJ_KEY:
        if ch in _WS:
            return state
        return (_STR, stack, 1) if ch == '"' else None
    if mode == _COLON:
        if ch in _WS:
            return state
        return (_VALUE, stack, 0) if ch == ":" else None
    raise AssertionError(f"bad state {state!r}")


def is_complete(state: State | None) -> bool:
    """True when the text read so far is one complete JSON value (trailing whitespace allowed)."""
    if state is None:
        return False
    mode, stack, aux = state
    if stack:
        return False
    return mode == _AFTER or (mode == _NUM and aux in _NUM_END_OK)
