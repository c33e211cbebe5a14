def test_models_and_chat(llama, openai_client):
    models = openai_client.models.list()
    assert "tiny-llama" in [m.id for m in models.data]
    out = openai_client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens >= 1
    stream = openai_client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content
