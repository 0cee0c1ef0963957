"""A black-box agent for the tests, written with one of the client libraries users bring (argv[1]: `openai`,
`openai-agents` or `litellm`), the way each one's documentation starts: it lists the models (the context
window an agent sizes its prompts by), then asks the model once. With openai-agents it also tries the
library's default model, the Responses API, and reports what the proxy answered.

It reads its row (JSON) on stdin and prints {"reward", "client", "version", "models", "reply", ...} on its
last line. OPENAI_BASE_URL and OPENAI_API_KEY come from beam-rl.
"""

import asyncio
import importlib.metadata
import json
import os
import sys


def with_openai(prompt: str) -> dict:
    from openai import OpenAI

    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    models = [m.model_dump() for m in client.models.list()]
    answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    return {"models": models, "reply": answer.choices[0].message.content}


def with_openai_agents(prompt: str) -> dict:
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its traces would go to the vendor's servers
    client = openai.AsyncOpenAI()

    async def main() -> dict:
        models = [m.model_dump() async for m in client.models.list()]
        agent = Agent(name="assistant", model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        result = await Runner.run(agent, prompt, max_turns=1)
        try:  # the library's default model speaks the Responses API
            await Runner.run(Agent(name="default", model="policy"), prompt, max_turns=1)
            responses = "answered"
        except openai.APIStatusError as exc:
            responses = f"{exc.status_code}: {exc.body.get('message') if isinstance(exc.body, dict) else exc.body}"
        return {"models": models, "reply": result.final_output, "responses_api": responses}

    return asyncio.run(main())


def with_litellm(prompt: str) -> dict:
    import litellm

    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    models = litellm.get_valid_models(check_provider_endpoint=True, custom_llm_provider="openai",
                                      api_base=base, api_key=key)
    answer = litellm.completion(model="openai/policy", messages=[{"role": "user", "content": prompt}],
                                api_base=base, api_key=key)
    return {"models": models, "reply": answer.choices[0].message.content}


CLIENTS = {"openai": ("openai", with_openai), "openai-agents": ("openai-agents", with_openai_agents),
           "litellm": ("litellm", with_litellm)}


def main() -> None:
    row = json.load(sys.stdin)
    distribution, run = CLIENTS[sys.argv[1]]
    result = run(row["prompt"])
    print(json.dumps({"reward": 1.0, "client": sys.argv[1], "version": importlib.metadata.version(distribution),
                      **result}))


if __name__ == "__main__":
    main()
