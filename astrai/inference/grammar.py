"""Compiling structured-output constraints with llguidance, once per tokenizer and grammar.

llguidance needs its own view of the tokenizer (`LLTokenizer`: every token's bytes, the EOS
ids); building it walks the vocabulary, so there is one per tokenizer (`grammar_compiler`),
built once: by `warm_up` (a server calls it at start-up), else at the first constrained
request. A grammar is compiled into an `LLMatcher` once and kept in an LRU keyed by the
grammar's text; each request gets a `deep_copy` of it (cheap: the compiled lexer and
parser tables are shared), so repeated schemas cost nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from functools import cached_property

import llguidance as llg

from astrai.inference.structured import StructuredOutput
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one tokenizer; thread-safe (the server's
    tokenizer threads and the engine loop share it).

    The matchers' EOS ids are the tokenizer's stop ids, so a complete output may end with
    any token that ends generation; ids at or past `vocab_size` (model padding) are never
    allowed (`constrain.GrammarRows` masks them).
    """

    def __init__(self, tokenizer: AutoTokenizer, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"cache_size must be a positive int, got {cache_size!r}")
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @cached_property
    def ll_tokenizer(self) -> llg.LLTokenizer:
        """llguidance's tokenizer, from our `tokenizers` tokenizer's JSON."""
        tok = self.tokenizer
        return llg.LLTokenizer(tok.backend.to_str(), n_vocab=len(tok), eos_token=tok.stop_ids)

    def warm_up(self) -> None:
        """Build `ll_tokenizer` now (seconds for a 150k vocabulary), so that the first
        constrained request does not stall the requests running beside it."""
        started = time.perf_counter()
        _ = self.ll_tokenizer
        logger.debug("llguidance tokenizer ready in %.2f s", time.perf_counter() - started)

    @property
    def vocab_size(self) -> int:
        """Token ids the masks cover; higher ids (model vocabulary padding) are masked out."""
        return self.ll_tokenizer.vocab_size

    def special_id(self, text: str) -> int | None:
        """The id of `text` if it is one special (or added) token, e.g. `<tool_call>`."""
        tid = self.tokenizer.token_to_id(text)
        return tid if tid is not None and self.ll_tokenizer.is_special_token(tid) else None

    def compile(self, spec: StructuredOutput) -> llg.LLMatcher:
        """The compiled, never-advanced matcher of `spec` (cached: do not advance it; use
        `matcher`). ValueError naming `spec.field` if the grammar does not compile, in
        `readable_error`'s words."""
        try:
            text = spec.grammar(self.special_id)
        except ValueError as err:
            raise ValueError(readable_error(str(err))) from None
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return cached
        try:
            matcher = llg.LLMatcher(self.ll_tokenizer, text, log_level=0)
            error = matcher.get_error() if matcher.is_error() else None
        except Exception as err:  # llguidance raises for some malformed grammars
            error = str(err)
        if error is not None:
            raise ValueError(f"{spec.field}: invalid {spec.kind}: {readable_error(error)}")
        with self._lock:
            self.misses += 1
            self._cache[text] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutput) -> llg.LLMatcher:
        """A fresh matcher of `spec` for one sequence (a copy of the cached compiled one)."""
        return self.compile(spec).deep_copy()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"grammars": len(self._cache), "hits": self.hits, "misses": self.misses}


# llguidance's grammar has 16-bit symbol ids: a larger grammar trips an assertion (a panic).
_SYMBOLS_PANIC = "grammar.symbols.len()"


def readable_error(error: str) -> str:
    """An llguidance error as a client may read it: never its Rust backtrace, and an
    internal assertion (a panic) said in our words."""
    text = error.split("<backtrace>")[0].strip()
    head, panic, rest = text.partition("panic:")
    if not panic:
        return text
    if _SYMBOLS_PANIC in rest:
        why = "the grammar is too large to compile (over llguidance's 65,525 grammar symbols)"
    else:
        why = "the grammar compiler failed on it (an internal limit of llguidance)"
    logger.warning("llguidance panicked: %s", rest.strip().splitlines()[0] if rest else "")
    return f"{head}{why}"


_compilers: weakref.WeakKeyDictionary[AutoTokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def grammar_compiler(tokenizer: AutoTokenizer) -> GrammarCompiler:
    """The one `GrammarCompiler` of `tokenizer` (the engine and the server share it, so a
    schema the server checked is already compiled when the engine runs it)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler
