#!/usr/bin/env python3
"""Generate chat-template test vectors for ember's Jinja engine.

Renders every template under tests/data/chat/templates/ against a fixed set
of conversations with Python's Jinja2, configured the way Hugging Face
transformers' apply_chat_template configures it:

  ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                extensions=[jinja2.ext.loopcontrols])
  filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent=..., ...)
  globals["raise_exception"], globals["strftime_now"]
  render(messages=..., tools=tools or None, documents=None,
         add_generation_prompt=..., bos_token=..., eos_token=...,
         [enable_thinking=...])

strftime_now uses a fixed Unix time (NOW, in UTC) so that the vectors are
reproducible; the C test renders with the same time and TZ=UTC.

Messages are first normalised exactly as ember's chat_messages does (see
src/chat/chat.h): null content -> "", role developer -> system, string
tool-call arguments decoded to objects for templates that iterate them as a
mapping, and lists of text parts joined with "\\n" for templates that do not
understand typed content. The expected output is what the template renders
from those normalised messages.

Output: tests/data/chat/vectors/<template>.json, a list of cases
  {"name", "messages", "tools", "add_generation_prompt", "enable_thinking"
   (absent = undefined), "bos_token", "eos_token", "now",
   "expected" (string) or "error" (the exception message)}.

Usage: python3 tools/gen_chat_vectors.py  (run from the repository root)
"""
import copy
import json
import os
import sys
import time
from datetime import datetime, timezone

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

NOW = 1700000000  # 2023-11-14 22:13:20 UTC

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(ROOT, "tests", "data", "chat", "templates")
VECTORS = os.path.join(ROOT, "tests", "data", "chat", "vectors")

TOKENS = {
    "chatml": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),
    "qwen3.5": ("", "<|im_end|>"),
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": ("<bos>", "<eos>"),
    "mistral-v0.3": ("<s>", "</s>"),
    "mistral-v7": ("<s>", "</s>"),
}
THINKING = {"qwen3", "qwen3.5"}


class TemplateRaised(Exception):
    pass


def make_env():
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.fromtimestamp(NOW, tz=timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def normalise(messages, source):
    object_args = ("arguments|items" in source or "arguments | items" in source
                   or "arguments.items()" in source)
    typed = "'text'" in source or '"text"' in source
    out = []
    for m in copy.deepcopy(messages):
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list) and not typed:
            m["content"] = "\n".join(p["text"] for p in m["content"] if p.get("type") == "text")
        if object_args and isinstance(m.get("tool_calls"), list):
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        parsed = json.loads(fn["arguments"])
                    except ValueError:
                        parsed = {}
                    fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        out.append(m)
    return out


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web (résumé: «quoted» \"text\")",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "default": 5}},
            "required": ["query"],
        },
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]

SYS = {"role": "system", "content": "You are a helpful assistant."}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello!"}], None),
    "system": ([SYS, {"role": "user", "content": "What is 2+2?"}], None),
    "multi_turn": ([SYS,
                    {"role": "user", "content": "Hi there."},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Tell me a joke."}], None),
    "multi_turn_nosys": ([{"role": "user", "content": "One"},
                          {"role": "assistant", "content": "Two"},
                          {"role": "user", "content": "Three"},
                          {"role": "assistant", "content": "Four"},
                          {"role": "user", "content": "Five?"}], None),
    "reasoning_field": ([{"role": "user", "content": "What is 17*3?"},
                         {"role": "assistant", "content": "51.",
                          "reasoning_content": "17*3 = 51, simple."},
                         {"role": "user", "content": "And 17*4?"}], None),
    "reasoning_inline": ([{"role": "user", "content": "Capital of France?"},
                          {"role": "assistant",
                           "content": "<think>\nThe user asks about France.\n</think>\n\nParis."},
                          {"role": "user", "content": "And Italy?"}], None),
    "last_assistant": ([{"role": "user", "content": "Start a story."},
                        {"role": "assistant", "content": "Once upon a time",
                         "reasoning_content": "Be creative."}], None),
    "whitespace_unicode": ([{"role": "system", "content": "  Trim me.  \n"},
                            {"role": "user",
                             "content": "  héllo — 日本語 \"quoted\" \\ back\ttab 😀\n\n"}], None),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                     {"type": "text", "text": "this, please."}]}],
                      None),
    "tools_defined": ([SYS, {"role": "user", "content": "Weather in Paris?"}], TOOLS),
    "tools_nosys": ([{"role": "user", "content": "Search for cats."}], TOOLS),
    "tool_call_object": ([{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": "",
                           "tool_calls": [call("abc123xyz", "get_weather",
                                               {"city": "Paris", "unit": "celsius"})]},
                          {"role": "tool", "tool_call_id": "abc123xyz", "name": "get_weather",
                           "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}], TOOLS),
    "tool_call_string": ([SYS, {"role": "user", "content": "Weather in Oslo?"},
                          {"role": "assistant", "content": "Let me check.",
                           "tool_calls": [call("xyz987abc", "get_weather",
                                               "{\"city\": \"Oslo\"}")]},
                          {"role": "tool", "tool_call_id": "xyz987abc",
                           "content": "{\"temperature\": -3}"},
                          {"role": "assistant", "content": "It is -3 degrees in Oslo."},
                          {"role": "user", "content": "Thanks!"}], TOOLS),
    "parallel_tools": ([{"role": "user", "content": "Weather in Paris and search news."},
                        {"role": "assistant", "content": "",
                         "tool_calls": [call("id0000001", "get_weather", {"city": "Paris"}),
                                        call("id0000002", "search",
                                             {"query": "news", "limit": 3, "tags": ["a", "b"]})]},
                        {"role": "tool", "tool_call_id": "id0000001", "content": "sunny"},
                        {"role": "tool", "tool_call_id": "id0000002", "content": "nothing new"},
                        {"role": "assistant", "content": "Sunny, and nothing new."},
                        {"role": "user", "content": "Great."}], TOOLS),
    "tool_call_long_id": ([{"role": "user", "content": "Weather?"},
                           {"role": "assistant", "content": "",
                            "tool_calls": [call("call_abcdef123456", "get_weather",
                                                {"city": "Rome"})]},
                           {"role": "tool", "tool_call_id": "call_abcdef123456",
                            "content": "warm"}], TOOLS),
    "no_user": ([SYS], None),
    "bad_alternation": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None),
}


# Engine micro-cases: (name, template, variables). Rendered the same way as
# the chat templates; written to vectors/micro.json.
MICRO = [
    ("text", "plain text", {}),
    ("print", "{{ x }}|{{ y }}|{{ z }}|{{ n }}|{{ f }}|{{ b }}", {"x": "s", "y": 3, "z": None, "n": -7, "f": 2.5, "b": True}),
    ("undefined_prints_empty", "[{{ nope }}]", {}),
    ("floats", "{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 1e20 }} {{ 1.5e-5 }} {{ 3.0 * 2 }}", {}),
    ("int_ops", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 - 4 }} {{ (1 + 2) * 3 }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ true ~ nope }}|{{ 'x' + 'y' }}|{{ [1] + [2, 3] }}", {}),
    ("compare", "{{ 1 < 2 }} {{ 2 <= 1 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ true == 1 }} {{ [1,2] == [1,2] }} {{ 'a' != 'a' }}", {}),
    ("logic", "{{ true and false }} {{ true or false }} {{ not true }} {{ 0 or 'x' }} {{ '' and 'y' }} {{ not 0 }}", {}),
    ("in", "{{ 'b' in 'abc' }} {{ 2 in [1,2] }} {{ 'k' in d }} {{ 'z' not in d }} {{ 3 not in [1] }}", {"d": {"k": 1}}),
    ("ternary", "{{ 'y' if t else 'n' }}{{ 'y' if f else 'n' }}[{{ 'only' if f }}]", {"t": True, "f": False}),
    ("filter_precedence", "{{ 'a' + ' b ' | trim + 'c' }}|{{ -3 | abs }}|{{ v | string if v is string else v | tojson }}", {"v": {"b": 1, "a": [1, 2]}}),
    ("if_elif_else", "{% for i in [1,2,3,4] %}{% if i == 1 %}one{% elif i == 2 %}two{% elif i == 3 %}three{% else %}other{% endif %},{% endfor %}", {}),
    ("for_loop_vars", "{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }};{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("for_prev_next", "{% for x in xs %}[{{ loop.previtem }}|{{ x }}|{{ loop.nextitem }}]{% endfor %}", {"xs": [1, 2, 3]}),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}", {}),
    ("for_filter", "{% for x in xs if x % 2 == 0 %}{{ x }}{{ loop.length }}{{ loop.last }},{% endfor %}", {"xs": [1, 2, 3, 4, 6]}),
    ("for_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d | items %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": 2}}),
    ("for_dict_keys", "{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("for_string", "{% for ch in 'héllo' %}{{ ch }}.{% endfor %}", {}),
    ("break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("set_scoping", "{% set y = 1 %}{% for x in [1,2] %}{% set y = y + 10 %}{{ y }},{% endfor %}{{ y }}", {}),
    ("set_in_if", "{% if true %}{% set y = 5 %}{% endif %}{{ y }}", {}),
    ("namespace", "{% set ns = namespace(a=1, found=false) %}{% for x in [1,2,3] %}{% set ns.a = ns.a + x %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.a }}{{ ns.found }}", {}),
    ("set_block", "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]", {}),
    ("set_tuple", "{% set a, b = [1, 2] %}{{ a }}{{ b }}", {}),
    ("macro", "{% macro m(a, b=2, c='z') %}[{{ a }}{{ b }}{{ c }}{{ g }}]{% endmacro %}{% set g = 'G' %}{{ m(1) }}{{ m(1, 3) }}{{ m(1, c='q') }}", {}),
    ("macro_in_expr", "{% macro up(s) %}{{ s | upper }}{% endmacro %}{{ up('ab') + '!' }}|{{ up('  x ') | trim }}", {}),
    ("subscript", "{{ xs[0] }}{{ xs[-1] }}{{ d['k'] }}{{ d.k }}{{ s[1] }}{{ s[-1] }}[{{ xs[9] }}]", {"xs": [1, 2, 3], "d": {"k": "v"}, "s": "héllo"}),
    ("slices", "{{ xs[1:] }}{{ xs[:2] }}{{ xs[::-1] }}{{ xs[::2] }}{{ xs[-2:] }}{{ s[::-1] }}{{ s[1:3] }}{{ s[:-1] }}", {"xs": [1, 2, 3, 4], "s": "héllo"}),
    ("attr_missing", "[{{ d.nope }}][{{ d.nope is defined }}][{{ none_v.x }}]", {"d": {"k": 1}, "none_v": None}),
    ("tests", "{{ x is defined }}{{ y is undefined }}{{ n is none }}{{ s is string }}{{ d is mapping }}{{ l is iterable }}{{ s is iterable }}{{ l is sequence }}{{ d is sequence }}{{ 3 is number }}{{ true is boolean }}{{ true is true }}{{ 0 is false }}{{ d is not mapping }}{{ 4 is even }}{{ 3 is odd }}{{ 6 is divisibleby 3 }}", {"x": 1, "n": None, "s": "s", "d": {}, "l": []}),
    ("filters_str", "{{ '  a b  ' | trim }}|{{ 'Ab' | lower }}|{{ 'ab' | upper }}|{{ 'hELLO world' | capitalize }}|{{ 'hello world' | title }}|{{ 'aXbX' | replace('X', '-') }}|{{ 3 | string }}|{{ 'x' | safe }}", {}),
    ("filters_list", "{{ xs | length }}|{{ xs | first }}|{{ xs | last }}|{{ xs | join(', ') }}|{{ xs | reverse | list }}|{{ 'abc' | length }}|{{ d | length }}|{{ xs | sum }}|{{ xs | min }}|{{ xs | max }}|{{ [1,1,2] | unique | list }}", {"xs": [3, 1, 2], "d": {"a": 1}}),
    ("filter_default", "{{ nope | default('d') }}|{{ '' | default('d') }}|{{ '' | default('d', true) }}|{{ none | default('d') }}|{{ x | d('q') }}", {"x": 0}),
    ("filter_map_select", "{{ ms | map(attribute='role') | join(',') }}|{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | list }}|{{ ms | rejectattr('role', 'equalto', 'user') | list | length }}|{{ ['a', 'b', 'c'] | reject('equalto', 'b') | join }}|{{ [0, 1, 2] | select | list }}|{{ ['x', 'y'] | map('upper') | join }}", {"ms": [{"role": "user", "c": 1}, {"role": "assistant", "c": 2}, {"role": "user", "c": 3}]}),
    ("filter_items_dictsort", "{{ d | items | list }}|{{ d | dictsort }}", {"d": {"b": 1, "A": 2, "c": 3}}),
    ("tojson", "{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n{{ 'é<>&\"\\n\\t\\u0001' | tojson }}\n{{ [] | tojson }}{{ {} | tojson }}{{ none | tojson }}{{ 1.5 | tojson }}", {"d": {"b": [1, 2.5, None, True, {"x": "é"}], "a": {}, "c": []}}),
    ("tojson_sort", "{{ d | tojson(sort_keys=true) }}|{{ d | tojson(ensure_ascii=true) }}", {"d": {"b": "ü😀", "a": 1}}),
    ("str_methods", "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\nab\\n'.lstrip('\\n') }}|{{ s.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b c'.split(' ', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith('bc') }}|{{ 'abc'.startswith(('x', 'a')) }}|{{ 'aXa'.replace('a', 'b') }}|{{ 'Ab'.upper() }}{{ 'Ab'.lower() }}|{{ 'ab cd'.title() }}|{{ 'abcb'.find('b') }}{{ 'abcb'.count('b') }}", {"s": "  a b\u00a0 c \n"}),
    ("dict_methods", "{{ d.get('a') }}|{{ d.get('z') }}|{{ d.get('z', 'dflt') }}|{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.items() | list }}", {"d": {"a": 1, "b": 2}}),
    ("repr", "{{ [1, 'a', none, true, 2.5, {'k': 'v'}] }}|{{ {'a': [1]} }}|{{ ['it\\'s'] }}", {}),
    ("list_dict_literals", "{% set l = [1, 2,] %}{% set d = {'a': 1, 'b': l} %}{{ d.b[1] }}{{ d['a'] }}{{ (1, 2) | length }}{{ 'x' in ('x', 'y') }}", {}),
    ("string_escapes", "{{ 'a\\tb\\nc\\\\d\\'e' }}|{{ \"q\\\"q\" }}|{{ '\\u00e9\\x41' }}", {}),
    ("adjacent_strings", "{{ 'a' 'b' \"c\" }}", {}),
    ("whitespace_control", "a  {%- if true -%}  b  {%- endif -%}  c\n  {{- 'd' -}}  \n e {{ 'f' }} {# comment #} g", {}),
    ("trim_lstrip_blocks", "<ul>\n  {% for i in [1, 2] %}\n    <li>{{ i }}</li>\n  {% endfor %}\n</ul>\n  {# note #}\nend\n", {}),
    ("lstrip_not_var", "x\n   {{ 1 }}\n   {% if true %}y{% endif %}   \n", {}),
    ("plus_modifier", "x\n  {%+ if true %}y\n{%+ endif %}z{% if true +%}\nw{% endif %}", {}),
    ("comment_ws", "a\n  {#- c -#}  \nb\n{# c2 #}\nc", {}),
    ("raw", "{% raw %}{{ not evaluated }}{% endraw %}!", {}),
    ("strftime", "{{ strftime_now('%Y-%m-%d %H:%M %d %b %Y') }}", {}),
    ("range", "{{ range(3) | list }}{{ range(1, 7, 2) | list }}{% for i in range(2) %}{{ i }}{% endfor %}", {}),
    ("nested_loops", "{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}", {}),
    ("loop_in_macro_scope", "{% macro m() %}{{ x }}{% endmacro %}{% set x = 'top' %}{% for i in [1] %}{% set x = 'loop' %}{{ m() }}{% endfor %}", {}),
    ("messages_like", "{% for m in messages %}{% if m.role == 'user' and not m.content.startswith('<tool') %}U:{{ m.content | trim }}{% elif m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endif %}\n{% endfor %}", {"messages": [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]}),
    ("chained_filters_tests", "{{ xs | selectattr('k') | map(attribute='k') | map('string') | join('-') }}|{{ (xs | length) > 1 }}|{{ xs[0].k is number }}", {"xs": [{"k": 1}, {"k": 0}, {"k": 3}]}),
    ("unicode_len_index", "{{ s | length }}{{ s[2] }}{{ s.upper() }}", {"s": "日本語x"}),
    ("none_compare", "{{ none == none }}{{ none is none }}{{ x is not none }}{{ nope == none }}", {"x": 1}),
]

MICRO_ERRORS = [
    ("raise", "a{{ raise_exception('boom here') }}", {}),
    ("undefined_attr_of_undefined", "{{ nope.x }}", {}),
    ("add_str_int", "{{ 'a' + 1 }}", {}),
    ("undefined_plus", "{{ nope + 1 }}", {}),
    ("ns_attr_on_dict", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("in_none", "{{ 'a' in none }}", {}),
    ("div_zero", "{{ 1 // 0 }}", {}),
]


def variants(name):
    """(add_generation_prompt, enable_thinking or None) pairs for a template."""
    out = [(True, None), (False, None)]
    if name in THINKING:
        out += [(True, True), (True, False), (False, False)]
    return out


def main():
    os.environ["TZ"] = "UTC"
    if hasattr(time, "tzset"):
        time.tzset()
    env = make_env()
    os.makedirs(VECTORS, exist_ok=True)
    total = 0
    for fname in sorted(os.listdir(TEMPLATES)):
        if not fname.endswith(".jinja"):
            continue
        tname = fname[: -len(".jinja")]
        with open(os.path.join(TEMPLATES, fname), encoding="utf-8") as f:
            source = f.read()
        tpl = env.from_string(source)
        bos, eos = TOKENS[tname]
        cases = []
        for cname, (messages, tools) in CONVERSATIONS.items():
            for agp, think in variants(tname):
                msgs = normalise(messages, source)
                kwargs = dict(messages=msgs, tools=tools, documents=None,
                              add_generation_prompt=agp, bos_token=bos, eos_token=eos)
                if think is not None:
                    kwargs["enable_thinking"] = think
                case = {"name": f"{cname}/agp={int(agp)}" + ("" if think is None else f"/think={int(think)}"),
                        "messages": messages, "tools": tools, "add_generation_prompt": agp,
                        "bos_token": bos, "eos_token": eos, "now": NOW}
                if think is not None:
                    case["enable_thinking"] = think
                try:
                    case["expected"] = tpl.render(**kwargs)
                except TemplateRaised as e:
                    case["error"] = str(e)
                except Exception as e:  # a Python-level failure of the template
                    case["error"] = f"{type(e).__name__}: {e}"
                cases.append(case)
        with open(os.path.join(VECTORS, tname + ".json"), "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False, indent=1)
            f.write("\n")
        ok = sum(1 for c in cases if "expected" in c)
        print(f"{tname}: {len(cases)} cases ({ok} renders, {len(cases) - ok} errors)")
        total += len(cases)

    micro = []
    for name, source, variables in MICRO + MICRO_ERRORS:
        case = {"name": name, "template": source, "vars": variables, "now": NOW}
        try:
            case["expected"] = env.from_string(source).render(**variables)
        except TemplateRaised as e:
            case["error"] = str(e)
        except Exception as e:
            case["error"] = f"{type(e).__name__}: {e}"
        micro.append(case)
    with open(os.path.join(VECTORS, "micro.json"), "w", encoding="utf-8") as f:
        json.dump(micro, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"micro: {len(micro)} cases ({sum(1 for c in micro if 'error' in c)} errors)")
    total += len(micro)
    print(f"total: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
