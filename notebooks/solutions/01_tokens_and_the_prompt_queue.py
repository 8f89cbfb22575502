# Solutions to notebook 01. Run from the notebook (uses ranks, SPECIAL, encode, chat, tok, HAVE_LLAMA3).
if HAVE_LLAMA3:
    # 1. Characters per token.
    samples = {
        "English": "The engine keeps a queue of requests and a fixed number of slots; each step it "
                   "runs the model once for every busy slot.",
        "Python": "for i, slot in enumerate(slots):\n    if slot is None and queue:\n        slots[i] = queue.popleft()",
        "German": "Die Maschine hält eine Warteschlange von Anfragen und eine feste Zahl von Plätzen.",
    }
    for name, text in samples.items():
        print(f"{name:8} {len(text) / len(tok.encode(text)):.2f} characters per token")

    # 2. decode by hand.
    inverse = {v: k for k, v in ranks.items()}
    inverse_special = {v: k.encode() for k, v in SPECIAL.items()}

    def decode(ids):
        return b"".join(inverse.get(i) or inverse_special[i] for i in ids).decode("utf-8", errors="replace")

    for ids in ORIGINAL_IDS.values():
        assert decode(ids) == tok.decode(ids), (decode(ids), tok.decode(ids))
    print(repr(decode(ORIGINAL_IDS["Say hello."])))

    # 3. A system prompt.
    def chat_with_system(prompt, system=None):
        ids = [BOS]
        if system is not None:
            ids += [SH] + encode("system") + [EH] + encode("\n\n" + system.strip()) + [EOT]
        ids += [SH] + encode("user") + [EH] + encode("\n\n" + prompt.strip()) + [EOT]
        return ids + [SH] + encode("assistant") + [EH] + encode("\n\n")

    sys_prompt = "You are terse."
    assert chat_with_system("Say hello.", sys_prompt) == tok.chat("Say hello.", system=sys_prompt)
    assert chat_with_system("Say hello.") == ORIGINAL_IDS["Say hello."]
    print("system prompt template matches pagedlab's")
