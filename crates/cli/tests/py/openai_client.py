"""Calls a running `seam serve` with the official openai client, greedy, streamed and not.

Usage: openai_client.py BASE_URL CHAT_PROMPT COMPLETION_PROMPT MAX_TOKENS
Prints one JSON object: the text and finish reason of each call, and the usage counts.
"""
import json
import sys

import openai

base_url, chat_prompt, completion_prompt, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key="unused")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": chat_prompt}]

chat = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
chat_stream_text, chat_stream_finish, chat_stream_usage = "", None, None
for chunk in client.chat.completions.create(
    model=model,
    messages=messages,
    temperature=0,
    max_tokens=max_tokens,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        chat_stream_usage = chunk.usage.completion_tokens
    for choice in chunk.choices:
        chat_stream_text += choice.delta.content or ""
        chat_stream_finish = choice.finish_reason or chat_stream_finish

completion = client.completions.create(model=model, prompt=completion_prompt, temperature=0, max_tokens=max_tokens)
completion_stream_text, completion_stream_finish = "", None
for chunk in client.completions.create(
    model=model, prompt=completion_prompt, temperature=0, max_tokens=max_tokens, stream=True
):
    for choice in chunk.choices:
        completion_stream_text += choice.text
        completion_stream_finish = choice.finish_reason or completion_stream_finish

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    missing_model_status = 200
except openai.NotFoundError as error:
    missing_model_status = error.status_code

print(
    json.dumps(
        {
            "model": model,
            "chat": chat.choices[0].message.content,
            "chat_finish": chat.choices[0].finish_reason,
            "chat_completion_tokens": chat.usage.completion_tokens,
            "chat_stream": chat_stream_text,
            "chat_stream_finish": chat_stream_finish,
            "chat_stream_completion_tokens": chat_stream_usage,
            "completion": completion.choices[0].text,
            "completion_finish": completion.choices[0].finish_reason,
            "completion_stream": completion_stream_text,
            "completion_stream_finish": completion_stream_finish,
            "missing_model_status": missing_model_status,
        }
    )
)
