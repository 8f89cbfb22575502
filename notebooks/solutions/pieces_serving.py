"""The solution to notebook 11's piece (checked by serving_course.check_sse_events).
Read it with serving_course.show_solution("sse_events"); PAGEDLAB_SOLUTIONS=1 makes the check use it."""
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
