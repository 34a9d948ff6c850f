"""Write ``minitrainer/tools/demo_preferences.jsonl``, the small preference dataset that ships with the package.

    python -m minitrainer.tools.make_demo_preferences     # rewrites minitrainer/tools/demo_preferences.jsonl

Built from ``demo_chat.jsonl`` alone, so it needs nothing downloaded: every conversation's last reply is the
chosen side; the rejected side is an evasive non-answer, or (every third pair) the last reply of another
conversation of the same kind, fluent but the answer to another question. Rows come in TRL's two preference
shapes: explicit ``prompt``/``chosen``/``rejected`` lists of messages, and every fourth one implicit
(``chosen`` and ``rejected`` whole conversations sharing their prompt).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
EVASIVE = ["I'm not sure, sorry.", "I can't help with that.", "You could look that up somewhere.",
           "That is hard to say.", "Maybe ask someone else?", "I don't know.",
           "It depends on many things.", "Let's talk about something else."]


def preference_rows(chat_rows: list[dict], seed: int) -> list[dict]:
    rng = random.Random(seed)
    conversations = [row for row in chat_rows if row["messages"][-1]["role"] == "assistant"]
    by_source: dict[str, list[dict]] = {}
    for row in conversations:
        by_source.setdefault(row["source"], []).append(row)
    pairs = []
    for index, row in enumerate(conversations):
        others = [other for other in by_source[row["source"]]
                  if other["messages"][-1]["content"] != row["messages"][-1]["content"]]
        if not others:
            continue
        prompt, chosen = row["messages"][:-1], row["messages"][-1]
        wrong = rng.choice(others)["messages"][-1]["content"] if index % 3 == 2 else rng.choice(EVASIVE)
        rejected = {"role": "assistant", "content": wrong}
        if index % 4 == 3:
            pairs.append({"id": row["id"], "chosen": [*prompt, chosen], "rejected": [*prompt, rejected]})
        else:
            pairs.append({"id": row["id"], "prompt": prompt, "chosen": [chosen], "rejected": [rejected]})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat", default=str(HERE / "demo_chat.jsonl"), help="the chat rows to pair")
    parser.add_argument("--output", default=str(HERE / "demo_preferences.jsonl"), help="jsonl to write")
    parser.add_argument("--seed", type=int, default=0, help="which other reply each pair rejects")
    args = parser.parse_args()
    chat_rows = [json.loads(line) for line in Path(args.chat).read_text(encoding="utf-8").splitlines()]
    with open(args.output, "w", encoding="utf-8") as f:
        for row in preference_rows(chat_rows, args.seed):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
