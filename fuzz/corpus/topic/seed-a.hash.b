a.#.b
a.x.y.b