"""JSON decoding with a regex (compressed FSM + jump-forward): extract a fixed record from a document; the
instruction is shared, the document differs per instance."""

from sglang_backend.lang.api import function, gen

NAME = "json_decode"
DESCRIPTION = "regex-constrained JSON extraction (compressed FSM, jump-forward)"
REUSE = True
HF = False  # HF generate has no regex constraint
SIZES = {
    "smoke": dict(n=4, document_tokens=20, max_tokens=48),
    "cpu": dict(n=8, document_tokens=80, max_tokens=96),
    "gpu": dict(n=96, document_tokens=300, max_tokens=128),
}
REGEX = (r'\{\n  "name": "[A-Za-z ]{1,16}",\n  "country": "[A-Za-z ]{1,16}",\n  "population": [0-9]{1,9},\n'
         r'  "capital": (true|false),\n  "landmarks": \["[A-Za-z ]{1,16}", "[A-Za-z ]{1,16}"\]\n\}')


def instances(tg, n, document_tokens, max_tokens):
    return [dict(document=tg.text(document_tokens), max_tokens=max_tokens) for _ in range(n)]


@function
def program(s, document, max_tokens):
    s += ("Extract the information about the city described in the document below as a JSON object with the "
          "fields name, country, population, capital and landmarks.\n\nDocument: ")
    s += document + "\n\nJSON:\n"
    s += gen("json", max_tokens=max_tokens, regex=REGEX)
