"""A black-box agent for the tests: a plain program using the `openai` package, as a user would write one.

It reads its row (JSON) on stdin, asks the model twice (the second time after a tool result it computes
itself), and prints {"reward", "replies", "tool"} on its last line. OPENAI_BASE_URL comes from beam-rl.
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    row = json.load(sys.stdin)
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=row.get("max_tokens", 8))
    reply = first.choices[0].message.content or ""
    tool_result = str(len(reply))  # the "tool": counts the characters of the first reply
    messages += [{"role": "assistant", "content": reply},
                 {"role": "tool", "name": "count_chars", "content": tool_result}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=row.get("max_tokens", 8))
    final = second.choices[0].message.content or ""
    reward = 1.0 if row.get("answer") and row["answer"] in final else 0.1 * (len(final) % 3)
    print("the agent may print anything before its result")
    print(json.dumps({"reward": reward, "replies": [reply, final], "tool": tool_result}))


if __name__ == "__main__":
    main()
