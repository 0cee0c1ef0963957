"""A verifiers v1 harness that calls the model from inside the env server's own event loop (one HTTP
client, no program per rollout), so what a rollout costs there is verifiers' env layer (interception,
trace, scoring) and not the OS process its stock `null` harness starts for each rollout.

`turns` > 1 is a tool environment: after each reply the harness appends a tool result (the length of the
reply, as a `count` tool would answer) and asks again, as an agent's tool loop does.
Its id is its module name, `vf_peer_direct` (bench/peers/shims on PYTHONPATH).
"""

import httpx
import verifiers.v1 as vf


class DirectConfig(vf.HarnessConfig):
    turns: int = 1


class DirectHarness(vf.Harness[DirectConfig]):
    NEEDS_CONTAINER = False  # the local subprocess runtime, which this harness never uses
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(timeout=None) as http:
            for turn in range(self.config.turns):
                answer = await http.post(
                    f"{endpoint}/chat/completions",
                    headers={"Authorization": f"Bearer {secret}"},
                    json={"model": ctx.model, "messages": messages},
                )
                if answer.status_code >= 400:
                    return vf.ProgramResult(0 if trace.stop_condition else 1, "", answer.text)
                message = answer.json()["choices"][0]["message"]
                messages.append({"role": "assistant", "content": message.get("content") or ""})
                if turn + 1 < self.config.turns:
                    messages.append({"role": "user", "content": f"count: {len(message.get('content') or '')}"})
        return vf.ProgramResult(0, "", "")


__all__ = ["DirectHarness"]
