"""The solutions to notebook 11's pieces (checked by serving_course.check_sse_events, check_numbering
and check_split_step). Read one with serving_course.show_solution("sse_events"); PAGEDLAB_SOLUTIONS=1
makes the checks use them."""
import json


def sse_events(byte_chunks):
    buf = b""                     # bytes of a line not finished yet
    data = []                     # the data: values of the event being read
    for piece in byte_chunks:
        buf += piece
        while b"\n" in buf:
            raw, buf = buf.split(b"\n", 1)
            line = raw.rstrip(b"\r").decode("utf-8")      # a whole line: no character is cut
            if line == "":                                # a blank line ends the event
                if data:
                    payload, data = "\n".join(data), []
                    if payload == "[DONE]":
                        return
                    yield json.loads(payload)
            elif line.startswith("data:"):
                value = line[5:]
                data.append(value[1:] if value.startswith(" ") else value)
            # other lines: a comment (':'), or a field we do not use (event:, id:, retry:)


def frontend_ids(f, n, count):
    # front end f of n: f, f + n, f + 2n, ... -- every front end's ids apart from every other's
    return [f + k * n for k in range(count)]


def owner(rid, n):
    # the remainder undoes the numbering: (f + k * n) % n == f
    return rid % n


def split_step(request_ids, token_ids, n):
    parts = {}                    # only front ends with a request in the step get a part
    for rid, toks in zip(request_ids, token_ids):
        ids, cols = parts.setdefault(owner(rid, n), ([], []))
        ids.append(rid)
        cols.append(toks)
    return parts
