"""Skeleton-of-thought: write a skeleton of points, then expand every point in parallel (fork) and join."""

from sglang_backend.lang.api import function, gen

NAME = "skeleton_of_thought"
DESCRIPTION = "skeleton, then fork(points) parallel expansions, join"
REUSE = True
HF = True
SIZES = {
    "smoke": dict(n=3, question_tokens=12, skeleton_tokens=6, points=3, point_tokens=4),
    "cpu": dict(n=4, question_tokens=30, skeleton_tokens=16, points=4, point_tokens=16),
    "gpu": dict(n=32, question_tokens=60, skeleton_tokens=48, points=5, point_tokens=64),
}


def instances(tg, n, question_tokens, skeleton_tokens, points, point_tokens):
    return [dict(question=tg.text(question_tokens) + "?", skeleton_tokens=skeleton_tokens, points=points,
                 point_tokens=point_tokens) for _ in range(n)]


@function
def program(s, question, skeleton_tokens, points, point_tokens):
    s += ("You are a helpful assistant. Give a skeleton of the answer as a short numbered list of points, "
          "then expand each point.\nQuestion: " + question + "\nSkeleton:")
    s += gen("skeleton", max_tokens=skeleton_tokens) + "\n"
    forks = s.fork(points)
    for i, f in enumerate(forks, 1):
        f += f"Expand point {i} in two sentences:" + gen("expansion", max_tokens=point_tokens)
    forks.join()
