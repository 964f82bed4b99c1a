"""Build the demo-moe training corpus from what an offline Debian machine has.

Domains (each document carries one label; the router analysis uses them):
  code   Python standard-library source (.py files of the running interpreter)
  docs   English technical prose: CPython docs (python3.11-doc, reST sources),
         Debian Reference (debian-reference-en), Git docs (git-doc),
         GNU Coding Standards + Information for Maintainers (gnu-standards)
  quotes fortune cookies (fortunes, fortunes-min) and Jargon File entries (jargon-text)
  arith  synthetic arithmetic lines such as "12 + 7 = 19"
  chat   ChatML conversations whose answers are copied from real sources:
         stdlib docstrings (via inspect), Jargon File definitions, exact arithmetic

Deterministic: sorted file lists, fixed seeds, hash-based held-out split.
Output: OUT/train.jsonl, OUT/heldout.jsonl (one {"domain","source","text"} per line)
        OUT/finetune.jsonl (the continued-training set for train.py --mix: core names in all five
        wordings, "I don't know" answers for names the corpus never asks about)
        OUT/sources.json (documents and characters per source).

Prerequisites (Debian 12):
  apt-get install python3.11-doc debian-reference-en git-doc gnu-standards \
                  fortunes fortunes-min jargon-text
"""

import argparse
import gzip
import hashlib
import importlib
import inspect
import json
import random
import re
import sys
import sysconfig
import warnings
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chatml import render  # noqa: E402

SEED = 1234
HELDOUT_MOD = 50  # 1 document in 50 goes to the held-out set

# Character budgets per domain (roughly 3-4 characters per token).
BUDGET = {
    "code": 9_000_000,
    "docs": 11_000_000,
    "quotes": 4_000_000,
    "arith": 1_600_000,
    "chat": None,  # everything that can be derived
}

PY_DOC = Path("/usr/share/doc/python3.11/html/_sources")
DEB_REF = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")
GIT_DOC = Path("/usr/share/doc/git-doc")
GNU_STD = [Path("/usr/share/doc/gnu-standards/standards.text.gz"),
           Path("/usr/share/doc/gnu-standards/maintain.text.gz")]
FORTUNE_DIR = Path("/usr/share/games/fortunes")
FORTUNE_FILES = ["computers", "debian", "definitions", "education", "fortunes",
                 "goedel", "humorists", "linux", "literature", "miscellaneous",
                 "paradoxum", "people", "platitudes", "pratchett", "riddles",
                 "science", "startrek", "tao", "wisdom", "work", "zippy"]
JARGON = Path("/usr/share/doc/jargon-text/jargon.txt.gz")

LICENSES = {
    "cpython-stdlib": "PSF License 2.0",
    "python3.11-doc": "PSF License 2.0 (Python documentation)",
    "debian-reference-en": "GPL-2+",
    "git-doc": "GPL-2",
    "gnu-standards": "GFDL-1.3+ (no invariant sections)",
    "fortunes": "BSD-3-Clause per debian/copyright (UC Regents); quotations are attributed third-party text",
    "jargon-text": "public domain",
    "synthetic-arith": "generated (no licence needed)",
    "chat-docstrings": "PSF License 2.0 (answers copied from stdlib docstrings)",
    "chat-jargon": "public domain (answers copied from the Jargon File)",
    "chat-arith": "generated",
    "chat-core": "PSF License 2.0 (answers copied from stdlib docstrings)",
    "chat-dontknow": "generated (fixed answer naming the asked name)",
}


def read_text(p: Path) -> str:
    if p.suffix == ".gz":
        with gzip.open(p, "rb") as f:
            data = f.read()
    else:
        data = p.read_bytes()
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def chunk(text: str, size: int, sep: str = "\n\n"):
    """Split text into pieces of about `size` chars at `sep` boundaries."""
    parts, cur, n = [], [], 0
    for para in text.split(sep):
        if n + len(para) > size and cur:
            parts.append(sep.join(cur))
            cur, n = [], 0
        cur.append(para)
        n += len(para) + len(sep)
    if cur:
        parts.append(sep.join(cur))
    return [p.strip("\n") for p in parts if p.strip()]


def squeeze_blank(text: str) -> str:
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# ---------------------------------------------------------------- code
def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_docs():
    root = stdlib_dir()
    skip = re.compile(r"(^|/)(test|tests|idle_test|site-packages|__pycache__|"
                      r"lib2to3/tests|turtledemo|ensurepip)(/|$)")
    files = sorted(p for p in root.rglob("*.py")
                   if not skip.search(str(p.relative_to(root))))
    for p in files:
        rel = str(p.relative_to(root))
        text = read_text(p)
        if "\x00" in text:
            continue
        for i, piece in enumerate(chunk(text, 5000, sep="\n\n\n") if len(text) > 6000 else [text]):
            # second pass for very long top-level blocks
            for j, sub in enumerate(chunk(piece, 5000, sep="\n\n") if len(piece) > 8000 else [piece]):
                yield {"domain": "code", "source": "cpython-stdlib",
                       "id": f"code:{rel}:{i}:{j}", "text": sub.strip("\n")}


# ---------------------------------------------------------------- docs
RST_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def clean_rst(text: str) -> str:
    out = []
    skip_block = False
    for line in text.split("\n"):
        s = line.strip()
        if skip_block:
            if s and not line.startswith((" ", "\t")):
                skip_block = False
            else:
                continue
        if s.startswith(".. ") and ("::" not in s or s.startswith((".. _", ".. index::", ".. toctree::",
                                                                     ".. |", ".. testsetup::",
                                                                     ".. testcleanup::", ".. highlight",
                                                                     ".. sectionauthor", ".. moduleauthor",
                                                                     ".. versionadded", ".. versionchanged",
                                                                     ".. deprecated", ".. only::",
                                                                     ".. raw::", ".. include::"))):
            if s.startswith((".. versionadded", ".. versionchanged", ".. deprecated")):
                out.append(re.sub(r"^\.\. (\w+)::",
                                  lambda m: m.group(1).replace("version", "Version ").capitalize() + ":", s))
                continue
            if s.startswith((".. toctree::", ".. index::", ".. |", ".. raw::", ".. only::")):
                skip_block = True
            continue
        m = re.match(r"^(\s*)\.\. [\w:-]+:: ?(.*)$", line)
        if m:
            line = m.group(1) + m.group(2)
        if re.match(r"^\s+:[\w-]+:( |$)", line) and not re.match(r"^\s+:[\w-]+:`", line):
            continue  # directive option
        line = RST_ROLE.sub(r"\1", line)
        line = line.replace("``", "`")
        out.append(line)
    return squeeze_blank("\n".join(out))


def docs_docs():
    subdirs = ["tutorial", "library", "reference", "howto", "faq", "using", "glossary.rst.txt",
               "extending", "c-api", "installing", "distributing"]
    files = []
    for s in subdirs:
        p = PY_DOC / s
        files += [p] if p.is_file() else sorted(p.rglob("*.rst.txt"))
    for p in files:
        rel = str(p.relative_to(PY_DOC))
        for i, piece in enumerate(chunk(clean_rst(read_text(p)), 4000)):
            yield {"domain": "docs", "source": "python3.11-doc", "id": f"docs:py:{rel}:{i}", "text": piece}
    for i, piece in enumerate(chunk(squeeze_blank(read_text(DEB_REF)), 4000)):
        yield {"domain": "docs", "source": "debian-reference-en", "id": f"docs:debref:{i}", "text": piece}
    for p in sorted(GIT_DOC.glob("*.txt")) + sorted(GIT_DOC.glob("*/*.txt")):
        rel = str(p.relative_to(GIT_DOC))
        for i, piece in enumerate(chunk(squeeze_blank(read_text(p)), 4000)):
            yield {"domain": "docs", "source": "git-doc", "id": f"docs:git:{rel}:{i}", "text": piece}
    for p in GNU_STD:
        for i, piece in enumerate(chunk(squeeze_blank(read_text(p)), 4000)):
            yield {"domain": "docs", "source": "gnu-standards", "id": f"docs:gnu:{p.name}:{i}", "text": piece}


# ---------------------------------------------------------------- quotes
def fortunes():
    quotes = []
    for name in FORTUNE_FILES:
        p = FORTUNE_DIR / name
        if not p.exists():
            continue
        for k, q in enumerate(read_text(p).split("\n%\n")):
            q = q.strip("\n")
            if 20 <= len(q) <= 400 and q.strip():
                quotes.append((f"{name}:{k}", q))
    return quotes


def jargon_entries():
    text = read_text(JARGON)
    # entries look like "   :term: pos.\n\n   body...\n\n   :next term: ..."
    start = text.find("   :(TM):")
    if start < 0:
        start = 0
    body = text[start:]
    end = body.find("\nAppendix A. Hacker Folklore\n")
    if end > 0:
        body = body[:end]
    entries = []
    for m in re.finditer(r"^   :([^\n:][^\n]*?):(.*?)\n(.*?)(?=^   :[^\n]+?:|\Z)", body, re.S | re.M):
        term, pos, defn = m.group(1).strip(), m.group(2).strip(), m.group(3)
        defn = "\n".join(l[3:] if l.startswith("   ") else l for l in defn.split("\n"))
        defn = squeeze_blank(defn)
        if len(defn) < 20:
            continue
        entries.append((term, pos, defn))
    return entries


def quote_docs(jargon):
    rng = random.Random(SEED + 1)
    quotes = fortunes()
    rng.shuffle(quotes)
    for g in range(0, len(quotes), 8):
        grp = quotes[g:g + 8]
        yield {"domain": "quotes", "source": "fortunes", "id": "quotes:fortune:" + grp[0][0],
               "text": "\n%\n".join(q for _, q in grp)}
    for g in range(0, len(jargon), 4):
        grp = jargon[g:g + 4]
        text = "\n\n".join(f":{t}: {p}\n\n{d}".replace(": \n", ":\n") for t, p, d in grp)
        yield {"domain": "quotes", "source": "jargon-text", "id": "quotes:jargon:" + grp[0][0], "text": text}


# ---------------------------------------------------------------- arithmetic
def arith_line(rng):
    op = rng.choice("+-*+-*+/")
    big = rng.random() < 0.3
    hi = 999 if big else 99
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    if op == "+":
        return f"{a} + {b}", a + b
    if op == "-":
        return f"{a} - {b}", a - b
    if op == "*":
        b = rng.randint(0, 12 if big else 20)
        return f"{a} * {b}", a * b
    b = rng.randint(1, 12)
    return f"{a * b} / {b}", a


def arith_docs():
    rng = random.Random(SEED + 2)
    total, k = 0, 0
    while total < BUDGET["arith"]:
        lines = [" = ".join((e, str(v))) for e, v in (arith_line(rng) for _ in range(rng.randint(16, 40)))]
        text = "\n".join(lines)
        total += len(text)
        yield {"domain": "arith", "source": "synthetic-arith", "id": f"arith:{k}", "text": text}
        k += 1


# ---------------------------------------------------------------- chat
DOC_MODULES = sorted("""
abc argparse array ast asyncio base64 binascii bisect builtins bz2 calendar cmath codecs collections
colorsys concurrent.futures configparser contextlib contextvars copy csv dataclasses datetime decimal
difflib dis email email.utils enum errno filecmp fnmatch fractions ftplib functools gc getpass gettext
glob graphlib gzip hashlib heapq hmac html html.parser http.client imaplib importlib inspect io
ipaddress itertools json keyword linecache locale logging lzma math mimetypes netrc numbers operator
os os.path pathlib pickle pkgutil platform plistlib poplib pprint queue quopri random re reprlib sched
secrets select selectors shlex shutil signal smtplib socket sqlite3 ssl stat statistics string struct
subprocess sys tarfile tempfile textwrap threading time timeit tokenize tomllib traceback tracemalloc
types typing unicodedata unittest urllib.parse urllib.request uuid warnings wave weakref
xml.dom.minidom xml.etree.ElementTree zipfile zlib zoneinfo
""".split())

BUILTIN_TYPES = ["str", "bytes", "list", "dict", "set", "frozenset", "tuple", "int", "float", "complex",
                 "bytearray", "range", "memoryview"]

QUESTION_FORMS = ["What does {n} do?", "What is {n} for?", "Explain {n} briefly.",
                  "Can you tell me what {n} does?", "What does {n} do in Python?"]
MODULE_FORMS = ["What is the {n} module?", "What is the {n} module for?", "Tell me about the {n} module."]
# The "core" chat set: everyday standard-library names, each asked in every training wording and
# repeated (CORE_REPEAT), so that a 10 M-parameter model can learn their answers. The last wording
# of QUESTION_FORMS is never used for them in training: the card asks it to see whether the answer
# carries over to a wording the model has not seen for that name.
CORE_NAMES = """
json.dumps json.loads json.dump json.load os.path.join os.path.exists os.path.basename os.path.dirname
os.path.splitext os.path.isfile os.path.isdir os.path.abspath os.listdir os.makedirs os.remove os.getcwd
os.getenv os.walk os.rename os.mkdir
str.split str.join str.strip str.replace str.lower str.upper str.startswith str.endswith str.find
str.format str.encode str.lstrip str.rstrip str.splitlines str.isdigit str.count str.title str.zfill
str.partition list.append list.extend list.pop list.sort list.insert list.remove list.reverse list.index
list.copy list.clear dict.get dict.items dict.keys dict.values dict.update dict.pop dict.setdefault
dict.fromkeys set.add set.union set.intersection set.discard bytes.decode
len print sorted enumerate zip range open isinstance map filter sum min max abs round input repr hash id
getattr setattr hasattr any all iter next reversed divmod pow chr ord hex bin format vars dir callable
collections.Counter collections.defaultdict collections.OrderedDict collections.deque
collections.namedtuple collections.ChainMap
itertools.chain itertools.product itertools.permutations itertools.combinations itertools.groupby
itertools.islice itertools.cycle itertools.count itertools.repeat itertools.accumulate
itertools.zip_longest functools.reduce functools.partial functools.lru_cache functools.wraps
functools.cache functools.total_ordering
math.sqrt math.floor math.ceil math.log math.gcd math.isclose math.pow math.exp math.sin
random.random random.randint random.choice random.shuffle random.sample random.uniform random.seed
re.compile re.match re.search re.sub re.findall re.split re.fullmatch re.escape re.finditer
time.time time.sleep time.perf_counter time.monotonic time.strftime datetime.datetime datetime.date
datetime.timedelta sys.exit shutil.copy shutil.rmtree shutil.move shutil.which shutil.copytree
subprocess.run subprocess.Popen subprocess.check_output
pathlib.Path pathlib.Path.exists pathlib.Path.read_text pathlib.Path.write_text pathlib.Path.mkdir
pathlib.Path.glob pathlib.Path.iterdir copy.copy copy.deepcopy pickle.dumps pickle.loads pickle.dump
pickle.load csv.reader csv.writer heapq.heappush heapq.heappop heapq.heapify
heapq.nlargest heapq.nsmallest bisect.bisect_left bisect.insort hashlib.sha256 hashlib.md5
base64.b64encode base64.b64decode uuid.uuid4 tempfile.mkdtemp tempfile.NamedTemporaryFile
tempfile.TemporaryDirectory textwrap.dedent textwrap.wrap textwrap.fill glob.glob fnmatch.fnmatch
statistics.mean statistics.median statistics.stdev argparse.ArgumentParser logging.getLogger
logging.basicConfig threading.Thread threading.Lock queue.Queue dataclasses.dataclass dataclasses.field
dataclasses.asdict enum.Enum contextlib.contextmanager contextlib.suppress typing.NamedTuple typing.cast
operator.itemgetter operator.attrgetter struct.pack struct.unpack zlib.compress zlib.decompress gzip.open
zipfile.ZipFile tarfile.open urllib.parse.urlparse urllib.parse.quote urllib.parse.urlencode
socket.socket inspect.signature inspect.getsource traceback.print_exc warnings.warn
string.Template difflib.unified_diff pprint.pprint shlex.split shlex.quote
""".split()
CORE_REPEAT = 3  # on top of train.py's --chat-repeat
CORE_MAX_CHARS = 200
JARGON_FORMS = ["What does \"{n}\" mean in hacker jargon?", "What is {n}?", "Define {n}."]
ARITH_FORMS = ["What is {e}?", "Compute {e}.", "How much is {e}?"]


def first_sentences(doc: str, max_chars=320):
    doc = inspect.cleandoc(doc)
    paras = [p for p in doc.split("\n\n") if p.strip()]
    if not paras:
        return None
    p = paras[0]
    # skip signature-like first paragraphs ("dumps(obj) -> str")
    if re.match(r"^[\w.]+\(.*\)(\s*->.*)?$", p.strip().split("\n")[0]) and len(paras) > 1:
        p = paras[1] if "\n" not in p.strip() else p.strip().split("\n", 1)[1]
    p = " ".join(p.split())
    if not p or len(p) < 15:
        return None
    sents = re.split(r"(?<=[.!?])\s+(?=[A-Z`'\"(])", p)
    out = sents[0]
    for s in sents[1:]:
        if len(out) + 1 + len(s) > max_chars:
            break
        out += " " + s
    if len(out) > max_chars + 200:
        return None
    return out


# modules an object may come from and still count as its documented module's own (C accelerators and the
# like)
OWNER_MODULES = ("posix", "posixpath", "_io", "_collections", "_functools", "_heapq", "_bisect", "_json",
                 "_operator", "_random", "_struct", "_socket", "_sqlite3", "_ssl", "_datetime", "_decimal",
                 "_pickle", "_csv", "_sha512", "_hashlib", "zlib", "math", "time")


def docstring_pairs():
    warnings.simplefilter("ignore")
    pairs = {}
    def add(qname, obj, kind):
        doc = getattr(obj, "__doc__", None)
        if not isinstance(doc, str):
            return
        ans = first_sentences(doc)
        if ans and qname not in pairs:
            pairs[qname] = (kind, ans)
    for mname in DOC_MODULES:
        try:
            mod = importlib.import_module(mname)
        except Exception:
            continue
        if mname != "builtins":
            add(mname, mod, "module")
        names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for n in sorted(set(names)):
            try:
                obj = getattr(mod, n)
            except Exception:
                continue
            if inspect.ismodule(obj):
                continue
            owner = getattr(obj, "__module__", None)
            top = mname.split(".")[0]
            if mname != "builtins" and owner and owner.split(".")[0] not in (top, "_" + top, *OWNER_MODULES):
                continue
            qn = n if mname == "builtins" else f"{mname}.{n}"
            if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj) or callable(obj):
                add(qn, obj, "callable")
            if inspect.isclass(obj) and owner and owner.split(".")[0].lstrip("_") == mname.split(".")[0]:
                for attr in sorted(vars(obj)):
                    if attr.startswith("_"):
                        continue
                    meth = vars(obj)[attr]
                    if isinstance(meth, (staticmethod, classmethod)):
                        meth = meth.__func__
                    if inspect.isfunction(meth) or inspect.ismethoddescriptor(meth) or isinstance(meth, property):
                        add(f"{qn}.{attr}", meth, "callable")
    for t in BUILTIN_TYPES:
        typ = getattr(__import__("builtins"), t)
        for n in sorted(vars(typ)):
            if n.startswith("_"):
                continue
            add(f"{t}.{n}", getattr(typ, n), "callable")
    return sorted((q, k, a) for q, (k, a) in pairs.items())


def core_pairs():
    """(name, answer) for CORE_NAMES: the first sentence(s) of each object's docstring."""
    import pydoc
    warnings.simplefilter("ignore")
    out = []
    for name in CORE_NAMES:
        obj = pydoc.locate(name)
        doc = getattr(obj, "__doc__", None)
        ans = first_sentences(doc, CORE_MAX_CHARS) if isinstance(doc, str) else None
        if not ans:
            raise SystemExit(f"core name without a usable docstring: {name}")
        out.append((name, ans))
    return out


def core_chat_docs():
    """One single-turn conversation per core name and training wording; always in the train split."""
    for name, ans in core_pairs():
        for i, form in enumerate(QUESTION_FORMS[:-1]):
            q = form.format(n=name)
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
            yield {"domain": "chat", "source": "chat-core", "id": f"chatcore:{name}:{i}", "text": render(msgs),
                   "questions": [q], "repeat": CORE_REPEAT, "core": True}


def chat_docs(jargon):
    rng = random.Random(SEED + 3)
    qa = []
    core = set(CORE_NAMES)
    for qn, kind, ans in docstring_pairs():
        if qn in core:
            continue
        if kind == "module":
            q = rng.choice(MODULE_FORMS).format(n=qn)
        else:
            q = rng.choice(QUESTION_FORMS).format(n=qn)
        qa.append(("chat-docstrings", qn, q, ans))
    for term, _pos, defn in jargon:
        ans = first_sentences(defn.replace("\n", " "), 300)
        if not ans or ans.startswith("["):
            # drop a leading etymology bracket
            ans = first_sentences(re.sub(r"^\[[^\]]*\]\s*", "", defn.replace("\n", " ")), 300)
        if ans:
            qa.append(("chat-jargon", term, rng.choice(JARGON_FORMS).format(n=term), ans))
    arng = random.Random(SEED + 4)
    for k in range(2500):
        e, v = arith_line(arng)
        qa.append(("chat-arith", f"arith{k}", rng.choice(ARITH_FORMS).format(e=e), f"{e} = {v}."))
    rng.shuffle(qa)
    i = 0
    while i < len(qa):
        n = rng.choice([1, 1, 1, 2, 3])
        grp = qa[i:i + n]
        i += n
        msgs = []
        for _, _, q, a in grp:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        yield {"domain": "chat", "source": grp[0][0], "id": "chat:" + "|".join(g[1] for g in grp),
               "text": render(msgs), "questions": [g[2] for g in grp]}
    yield from core_chat_docs()


# ---------------------------------------------------------------- continued-training set
# `finetune.jsonl` (written next to train.jsonl, used by `train.py --mix`): the core set in all five
# QUESTION_FORMS, and "I don't know" answers for names that no chat question of the corpus is about.
# No chat document ever uses UNSEEN_FORM, so the card can still ask the core names a wording the model
# never saw. Unknown names are split by a hash of the name: 3 in 4 are taught, the rest only evaluated.
UNSEEN_FORM = "Tell me what {n} does."
FINETUNE_CORE_REPEAT = 2  # the docstrings are harder to learn than the one fixed "don't know" answer
DONTKNOW = "I don't know what {n} is."
# Real standard-library modules outside DOC_MODULES: their names are asked nowhere in the corpus.
UNKNOWN_MODULES = sorted("""
optparse getopt mailbox pydoc doctest pdb bdb cmd code codeop pyclbr py_compile compileall runpy
modulefinder symtable tabnanny trace pstats cProfile webbrowser wsgiref.util xmlrpc.client socketserver
http.server http.cookies mailcap sndhdr imghdr uu nntplib telnetlib cgi crypt pty tty curses readline
rlcompleter mmap fcntl resource grp pwd termios atexit faulthandler sysconfig site zipimport zipapp venv
turtle ctypes multiprocessing asyncore asynchat smtpd xdrlib aifc sunau audioop stringprep cgitb chunk
pipes nis spwd ossaudiodev tkinter
""".split())
# Made-up names under the prefixes the core set uses, so a familiar prefix is no cue by itself.
FAKE_PREFIXES = ["", "os.", "os.path.", "json.", "str.", "list.", "dict.", "set.", "math.", "re.", "random.",
                 "time.", "sys.", "shutil.", "itertools.", "functools.", "collections.", "pathlib.Path.",
                 "subprocess.", "datetime.", "statistics.", "textwrap.", "heapq.", "copy."]
ONSETS = ["b", "bl", "br", "d", "dr", "f", "fl", "fr", "g", "gl", "gr", "k", "kl", "m", "n", "p", "pl", "sn",
          "sp", "st", "tr", "v", "w", "z"]
NUCLEI = ["a", "e", "i", "o", "u", "oo", "ee", "ai"]
CODAS = ["b", "ck", "g", "mp", "nk", "p", "rp", "sh", "t", "x", "zz", "ble", "zle", "rk", "nd", "ff"]


def unknown_names():
    """(taught, evaluated): sorted lists of (name, kind) with kind "real" or "made-up", names that no
    chat question of the corpus is about. A hash of the name puts 1 in 4 in the evaluated list."""
    import pydoc
    warnings.simplefilter("ignore")
    known = {q for q, _, _ in docstring_pairs()} | set(CORE_NAMES)
    names = {}
    for mname in UNKNOWN_MODULES:
        try:
            mod = importlib.import_module(mname)
        except Exception:
            continue  # not built on this interpreter
        for n in sorted(dir(mod)):
            obj = getattr(mod, n, None)
            qn = f"{mname}.{n}"
            if n.startswith("_") or inspect.ismodule(obj) or not callable(obj) or qn in known:
                continue
            owner = getattr(obj, "__module__", None)
            if isinstance(owner, str) and owner.split(".")[0].lstrip("_") not in (mname.split(".")[0], "builtins"):
                continue  # a re-export such as aifc.namedtuple is another module's name
            names[qn] = "real"
    rng = random.Random(SEED + 5)
    n_real = len(names)
    while len(names) < 2 * n_real:
        word = "".join(rng.choice(ONSETS) + rng.choice(NUCLEI) for _ in range(rng.choice([1, 1, 2])))
        qn = rng.choice(FAKE_PREFIXES) + word + rng.choice(CODAS)
        if qn in known or qn in names or pydoc.locate(qn) is not None:
            continue
        names[qn] = "made-up"
    def held(qn):
        return int(hashlib.sha256(("unknown:" + qn).encode()).hexdigest(), 16) % 4 == 0
    taught = sorted((n, k) for n, k in names.items() if not held(n))
    evaluated = sorted((n, k) for n, k in names.items() if held(n))
    return taught, evaluated


def finetune_docs():
    """The continued-training set: every core name in all five QUESTION_FORMS (one question per
    conversation), and one "I don't know" conversation per taught unknown name in a random form."""
    for name, ans in core_pairs():
        for i, form in enumerate(QUESTION_FORMS):
            q = form.format(n=name)
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
            yield {"domain": "chat", "source": "chat-core", "id": f"finetune:core:{name}:{i}",
                   "text": render(msgs), "questions": [q], "core": True, "repeat": FINETUNE_CORE_REPEAT}
    rng = random.Random(SEED + 6)
    for name, kind in unknown_names()[0]:
        q = rng.choice(QUESTION_FORMS).format(n=name)
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": DONTKNOW.format(n=name)}]
        yield {"domain": "chat", "source": "chat-dontknow", "id": f"finetune:unknown:{name}",
               "text": render(msgs), "questions": [q], "unknown": kind}


# ---------------------------------------------------------------- main
def is_heldout(doc_id: str) -> bool:
    return int(hashlib.sha256(doc_id.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def take_budget(docs, budget, seed):
    docs = list(docs)
    if budget is None:
        return docs
    rng = random.Random(seed)
    rng.shuffle(docs)
    out, n = [], 0
    for d in docs:
        if n >= budget:
            break
        out.append(d)
        n += len(d["text"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/work/demo_build/corpus")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jargon = jargon_entries()
    print(f"jargon entries: {len(jargon)}", file=sys.stderr)
    all_docs = []
    for dom, gen, seed in [("code", code_docs(), 11), ("docs", docs_docs(), 12),
                           ("quotes", quote_docs(jargon), 13), ("arith", arith_docs(), 14),
                           ("chat", chat_docs(jargon), 15)]:
        docs = take_budget(gen, BUDGET[dom], seed)
        print(f"{dom}: {len(docs)} docs, {sum(len(d['text']) for d in docs)} chars", file=sys.stderr)
        all_docs += docs
    rng = random.Random(SEED)
    rng.shuffle(all_docs)
    stats = defaultdict(lambda: Counter())
    with open(out / "train.jsonl", "w") as ft, open(out / "heldout.jsonl", "w") as fh:
        for d in all_docs:
            split = "heldout" if is_heldout(d["id"]) and not d.get("core") else "train"
            (fh if split == "heldout" else ft).write(json.dumps(d, ensure_ascii=False) + "\n")
            stats[f"{split}:{d['domain']}:{d['source']}"].update(docs=1, chars=len(d["text"]))
    meta = {"python": sys.version, "stdlib": str(stdlib_dir()), "seed": SEED,
            "licenses": LICENSES, "stats": {k: dict(v) for k, v in sorted(stats.items())}}
    ft = list(finetune_docs())
    with open(out / "finetune.jsonl", "w") as f:
        for d in ft:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
            stats[f"finetune:{d['domain']}:{d['source']}"].update(docs=1, chars=len(d["text"]))
    (out / "sources.json").write_text(json.dumps(meta, indent=1))
    for k, v in sorted(stats.items()):
        print(k, dict(v), file=sys.stderr)


if __name__ == "__main__":
    main()
