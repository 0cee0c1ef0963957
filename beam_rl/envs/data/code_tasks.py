"""The code environment's tasks, written for beam-rl: a function stub with its docstring, assert-style
tests, and a reference solution that passes them (make_datasets.py splits them into code_*.jsonl)."""

from __future__ import annotations

from typing import NamedTuple


class CodeTask(NamedTuple):
    task_id: str
    prompt: str
    reference: str  # the body that completes `prompt`
    tests: tuple[str, ...]


TASKS: tuple[CodeTask, ...] = (
    CodeTask(
        "count_vowels",
        '''\
def count_vowels(text: str) -> int:
    """Return how many letters of `text` are vowels (a, e, i, o, u), ignoring case."""
''',
        '''\
    return sum(1 for ch in text.lower() if ch in 'aeiou')
''',
        (
            "assert count_vowels('') == 0",
            "assert count_vowels('Beam') == 2",
            "assert count_vowels('rhythm') == 0",
            "assert count_vowels('AEIOU aeiou') == 10",
            "assert count_vowels('Reinforcement') == 5",
        ),
    ),
    CodeTask(
        "is_palindrome",
        '''\
def is_palindrome(text: str) -> bool:
    """Return True if `text` reads the same backwards, looking only at letters and digits and
    ignoring case."""
''',
        '''\
    kept = [ch.lower() for ch in text if ch.isalnum()]
    return kept == kept[::-1]
''',
        (
            "assert is_palindrome('') == True",
            "assert is_palindrome('Never odd or even') == True",
            "assert is_palindrome('rollout') == False",
            "assert is_palindrome('12,21') == True",
            "assert is_palindrome('ab') == False",
        ),
    ),
    CodeTask(
        "running_sum",
        '''\
def running_sum(values: list[int]) -> list[int]:
    """Return the list whose i-th item is the sum of values[0] .. values[i]."""
''',
        '''\
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
''',
        (
            'assert running_sum([]) == []',
            'assert running_sum([5]) == [5]',
            'assert running_sum([1, 2, 3, 4]) == [1, 3, 6, 10]',
            'assert running_sum([3, -3, 3]) == [3, 0, 3]',
        ),
    ),
    CodeTask(
        "second_largest",
        '''\
def second_largest(values: list[int]) -> int | None:
    """Return the second largest distinct value in `values`, or None if there are fewer than two
    distinct values."""
''',
        '''\
    distinct = sorted(set(values))
    return distinct[-2] if len(distinct) >= 2 else None
''',
        (
            'assert second_largest([4, 1, 7, 3]) == 4',
            'assert second_largest([7, 7, 7]) == None',
            'assert second_largest([]) == None',
            'assert second_largest([2, 9, 9, 5]) == 5',
            'assert second_largest([-1, -5]) == -5',
        ),
    ),
    CodeTask(
        "chunk",
        '''\
def chunk(items: list, size: int) -> list[list]:
    """Split `items` into consecutive lists of `size` items; the last one may be shorter."""
''',
        '''\
    return [items[i:i + size] for i in range(0, len(items), size)]
''',
        (
            'assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]',
            'assert chunk([], 3) == []',
            "assert chunk(['a', 'b'], 5) == [['a', 'b']]",
            'assert chunk([1, 2, 3], 1) == [[1], [2], [3]]',
        ),
    ),
    CodeTask(
        "flatten",
        '''\
def flatten(nested: list) -> list:
    """Return the non-list items of `nested`, a list whose items may be lists nested to any depth,
    in order."""
''',
        '''\
    out = []
    for item in nested:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out
''',
        (
            'assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]',
            'assert flatten([]) == []',
            'assert flatten([[], [[]]]) == []',
            "assert flatten(['a', ['b', 'c']]) == ['a', 'b', 'c']",
        ),
    ),
    CodeTask(
        "run_length_encode",
        '''\
def run_length_encode(text: str) -> str:
    """Encode each run of a repeated character as the character followed by the run's length,
    e.g. "aaab" -> "a3b1"."""
''',
        '''\
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f'{text[i]}{j - i}')
        i = j
    return ''.join(out)
''',
        (
            "assert run_length_encode('aaab') == 'a3b1'",
            "assert run_length_encode('') == ''",
            "assert run_length_encode('abc') == 'a1b1c1'",
            "assert run_length_encode('zzzzzzzzzzzz') == 'z12'",
            "assert run_length_encode('aabbaa') == 'a2b2a2'",
        ),
    ),
    CodeTask(
        "run_length_decode",
        '''\
def run_length_decode(encoded: str) -> str:
    """Invert run-length encoding: each letter is followed by a count of one or more digits,
    e.g. "a3b1" -> "aaab" and "x12" -> twelve x's."""
''',
        '''\
    out = []
    i = 0
    while i < len(encoded):
        ch = encoded[i]
        j = i + 1
        while j < len(encoded) and encoded[j].isdigit():
            j += 1
        out.append(ch * int(encoded[i + 1:j]))
        i = j
    return ''.join(out)
''',
        (
            "assert run_length_decode('a3b1') == 'aaab'",
            "assert run_length_decode('') == ''",
            "assert run_length_decode('x12') == 'xxxxxxxxxxxx'",
            "assert run_length_decode('a1b2c3') == 'abbccc'",
        ),
    ),
    CodeTask(
        "caesar_shift",
        '''\
def caesar_shift(text: str, shift: int) -> str:
    """Shift every ASCII letter of `text` by `shift` places in the alphabet, wrapping around and
    keeping its case; other characters stay as they are. `shift` may be negative."""
''',
        '''\
    out = []
    for ch in text:
        if 'a' <= ch <= 'z':
            out.append(chr((ord(ch) - 97 + shift) % 26 + 97))
        elif 'A' <= ch <= 'Z':
            out.append(chr((ord(ch) - 65 + shift) % 26 + 65))
        else:
            out.append(ch)
    return ''.join(out)
''',
        (
            "assert caesar_shift('abc', 1) == 'bcd'",
            "assert caesar_shift('xyz', 3) == 'abc'",
            "assert caesar_shift('Hello, World!', 13) == 'Uryyb, Jbeyq!'",
            "assert caesar_shift('bcd', -1) == 'abc'",
            "assert caesar_shift('Zz', 52) == 'Zz'",
        ),
    ),
    CodeTask(
        "digit_sum",
        '''\
def digit_sum(n: int) -> int:
    """Return the sum of the decimal digits of `n` (its absolute value if negative)."""
''',
        '''\
    return sum(int(d) for d in str(abs(n)))
''',
        (
            'assert digit_sum(0) == 0',
            'assert digit_sum(1234) == 10',
            'assert digit_sum(-907) == 16',
            'assert digit_sum(99999) == 45',
        ),
    ),
    CodeTask(
        "collatz_steps",
        '''\
def collatz_steps(n: int) -> int:
    """Return how many steps the Collatz rule (halve an even number, map an odd one to 3n + 1)
    takes to bring the positive integer `n` down to 1."""
''',
        '''\
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
''',
        (
            'assert collatz_steps(1) == 0',
            'assert collatz_steps(2) == 1',
            'assert collatz_steps(6) == 8',
            'assert collatz_steps(27) == 111',
        ),
    ),
    CodeTask(
        "gcd_of_list",
        '''\
def gcd_of_list(values: list[int]) -> int:
    """Return the greatest common divisor of the positive integers in `values` (at least one)."""
''',
        '''\
    result = 0
    for v in values:
        a, b = result, v
        while b:
            a, b = b, a % b
        result = a
    return result
''',
        (
            'assert gcd_of_list([12]) == 12',
            'assert gcd_of_list([12, 18]) == 6',
            'assert gcd_of_list([7, 13, 29]) == 1',
            'assert gcd_of_list([100, 75, 50]) == 25',
        ),
    ),
    CodeTask(
        "primes_below",
        '''\
def primes_below(limit: int) -> list[int]:
    """Return every prime number smaller than `limit`, in increasing order."""
''',
        '''\
    if limit < 3:
        return []
    sieve = [True] * limit
    sieve[0] = sieve[1] = False
    for i in range(2, int(limit ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = [False] * len(sieve[i * i::i])
    return [i for i, is_prime in enumerate(sieve) if is_prime]
''',
        (
            'assert primes_below(2) == []',
            'assert primes_below(3) == [2]',
            'assert primes_below(20) == [2, 3, 5, 7, 11, 13, 17, 19]',
            'assert len(primes_below(1000)) == 168',
        ),
    ),
    CodeTask(
        "merge_sorted",
        '''\
def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two lists that are each sorted in increasing order into one sorted list."""
''',
        '''\
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    return out + left[i:] + right[j:]
''',
        (
            'assert merge_sorted([1, 4, 9], [2, 3, 10]) == [1, 2, 3, 4, 9, 10]',
            'assert merge_sorted([], [1, 2]) == [1, 2]',
            'assert merge_sorted([5], []) == [5]',
            'assert merge_sorted([1, 1], [1]) == [1, 1, 1]',
        ),
    ),
    CodeTask(
        "rotate_left",
        '''\
def rotate_left(items: list, steps: int) -> list:
    """Return `items` rotated left by `steps` places (steps may exceed the length)."""
''',
        '''\
    if not items:
        return []
    steps %= len(items)
    return items[steps:] + items[:steps]
''',
        (
            'assert rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]',
            'assert rotate_left([1, 2, 3], 3) == [1, 2, 3]',
            'assert rotate_left([1, 2, 3], 5) == [3, 1, 2]',
            'assert rotate_left([], 4) == []',
        ),
    ),
    CodeTask(
        "word_counts",
        '''\
def word_counts(text: str) -> dict[str, int]:
    """Count the words of `text`: words are separated by whitespace and compared in lower case."""
''',
        '''\
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts
''',
        (
            "assert word_counts('') == {}",
            "assert word_counts('the cat the hat') == {'the': 2, 'cat': 1, 'hat': 1}",
            "assert word_counts('Go go  GO') == {'go': 3}",
            "assert word_counts('a\\nb\\ta') == {'a': 2, 'b': 1}",
        ),
    ),
    CodeTask(
        "transpose",
        '''\
def transpose(matrix: list[list[int]]) -> list[list[int]]:
    """Return the transpose of a rectangular matrix given as a list of rows."""
''',
        '''\
    return [list(column) for column in zip(*matrix)]
''',
        (
            'assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]',
            'assert transpose([[7]]) == [[7]]',
            'assert transpose([]) == []',
            'assert transpose([[1, 2]]) == [[1], [2]]',
        ),
    ),
    CodeTask(
        "binary_search",
        '''\
def binary_search(sorted_values: list[int], target: int) -> int:
    """Return the index of `target` in the increasing list `sorted_values` (its values are
    distinct), or -1 if it is absent."""
''',
        '''\
    lo, hi = 0, len(sorted_values) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if sorted_values[mid] == target:
            return mid
        if sorted_values[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
        (
            'assert binary_search([1, 3, 5, 7, 9], 7) == 3',
            'assert binary_search([1, 3, 5, 7, 9], 1) == 0',
            'assert binary_search([1, 3, 5, 7, 9], 4) == -1',
            'assert binary_search([], 1) == -1',
            'assert binary_search(list(range(0, 2000, 2)), 1998) == 999',
        ),
    ),
    CodeTask(
        "roman_to_int",
        '''\
def roman_to_int(numeral: str) -> int:
    """Return the value of a Roman numeral written in upper case, e.g. "XIV" -> 14."""
''',
        '''\
    values = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}
    total = 0
    for i, ch in enumerate(numeral):
        v = values[ch]
        if i + 1 < len(numeral) and values[numeral[i + 1]] > v:
            total -= v
        else:
            total += v
    return total
''',
        (
            "assert roman_to_int('III') == 3",
            "assert roman_to_int('XIV') == 14",
            "assert roman_to_int('XC') == 90",
            "assert roman_to_int('MMXXVI') == 2026",
            "assert roman_to_int('CDXLIV') == 444",
        ),
    ),
    CodeTask(
        "int_to_roman",
        '''\
def int_to_roman(n: int) -> str:
    """Write 1 <= n <= 3999 as a Roman numeral in upper case, e.g. 14 -> "XIV"."""
''',
        '''\
    parts = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'),
             (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]
    out = []
    for value, symbol in parts:
        while n >= value:
            out.append(symbol)
            n -= value
    return ''.join(out)
''',
        (
            "assert int_to_roman(1) == 'I'",
            "assert int_to_roman(14) == 'XIV'",
            "assert int_to_roman(944) == 'CMXLIV'",
            "assert int_to_roman(3999) == 'MMMCMXCIX'",
        ),
    ),
    CodeTask(
        "brackets_balanced",
        '''\
def brackets_balanced(text: str) -> bool:
    """Return True if the brackets (), [] and {} in `text` are balanced and properly nested; other
    characters are ignored."""
''',
        '''\
    pairs = {')': '(', ']': '[', '}': '{'}
    stack = []
    for ch in text:
        if ch in '([{':
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack
''',
        (
            "assert brackets_balanced('') == True",
            "assert brackets_balanced('f(a[1], {b: 2})') == True",
            "assert brackets_balanced('(]') == False",
            "assert brackets_balanced('((') == False",
            "assert brackets_balanced('}{') == False",
        ),
    ),
    CodeTask(
        "common_prefix",
        '''\
def common_prefix(words: list[str]) -> str:
    """Return the longest string that every word in `words` starts with ("" for no words)."""
''',
        '''\
    if not words:
        return ''
    prefix = words[0]
    for word in words[1:]:
        while not word.startswith(prefix):
            prefix = prefix[:-1]
    return prefix
''',
        (
            "assert common_prefix(['policy', 'polish', 'pole']) == 'pol'",
            "assert common_prefix(['batch']) == 'batch'",
            "assert common_prefix([]) == ''",
            "assert common_prefix(['step', 'rollout']) == ''",
        ),
    ),
    CodeTask(
        "group_anagrams",
        '''\
def group_anagrams(words: list[str]) -> list[list[str]]:
    """Group the words that are anagrams of each other. Sort each group, and sort the groups by
    their first word."""
''',
        '''\
    groups = {}
    for word in words:
        groups.setdefault(''.join(sorted(word)), []).append(word)
    return sorted(sorted(group) for group in groups.values())
''',
        (
            "assert group_anagrams(['tea', 'eat', 'tan', 'ate', 'nat']) == [['ate', 'eat', 'tea'], ['nat', 'tan']]",
            'assert group_anagrams([]) == []',
            "assert group_anagrams(['abc']) == [['abc']]",
            "assert group_anagrams(['ab', 'ba', 'c']) == [['ab', 'ba'], ['c']]",
        ),
    ),
    CodeTask(
        "dedupe",
        '''\
def dedupe(items: list) -> list:
    """Return `items` without repeats, keeping the first occurrence of each and the order."""
''',
        '''\
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''',
        (
            'assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]',
            'assert dedupe([]) == []',
            "assert dedupe(['a', 'a', 'a']) == ['a']",
            'assert dedupe([1, 2, 3]) == [1, 2, 3]',
        ),
    ),
    CodeTask(
        "count_islands",
        '''\
def count_islands(grid: list[str]) -> int:
    """Count the islands in `grid`, rows of "#" (land) and "." (water): an island is a group of
    land cells joined up, down, left or right."""
''',
        '''\
    seen = set()
    count = 0
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if cell != '#' or (r, c) in seen:
                continue
            count += 1
            stack = [(r, c)]
            seen.add((r, c))
            while stack:
                y, x = stack.pop()
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < len(grid) and 0 <= nx < len(grid[ny]) and grid[ny][nx] == '#' and (ny, nx) not in seen:
                        seen.add((ny, nx))
                        stack.append((ny, nx))
    return count
''',
        (
            'assert count_islands([]) == 0',
            "assert count_islands(['#.#', '...', '#.#']) == 4",
            "assert count_islands(['##.', '.#.', '.##']) == 1",
            "assert count_islands(['#.', '.#']) == 2",
            "assert count_islands(['...']) == 0",
        ),
    ),
    CodeTask(
        "spiral_order",
        '''\
def spiral_order(matrix: list[list[int]]) -> list[int]:
    """Return the items of a rectangular matrix in clockwise spiral order, starting top left."""
''',
        '''\
    out = []
    rows = [list(r) for r in matrix]
    while rows:
        out.extend(rows.pop(0))
        rows = [list(r) for r in zip(*rows)][::-1]
    return out
''',
        (
            'assert spiral_order([[1, 2, 3], [4, 5, 6], [7, 8, 9]]) == [1, 2, 3, 6, 9, 8, 7, 4, 5]',
            'assert spiral_order([[1, 2], [3, 4], [5, 6]]) == [1, 2, 4, 6, 5, 3]',
            'assert spiral_order([]) == []',
            'assert spiral_order([[1, 2, 3]]) == [1, 2, 3]',
        ),
    ),
    CodeTask(
        "fibonacci",
        '''\
def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1."""
''',
        '''\
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
''',
        (
            'assert fibonacci(0) == 0',
            'assert fibonacci(1) == 1',
            'assert fibonacci(10) == 55',
            'assert fibonacci(90) == 2880067194370816120',
        ),
    ),
    CodeTask(
        "pairs_with_sum",
        '''\
def pairs_with_sum(values: list[int], target: int) -> list[tuple[int, int]]:
    """Return every pair (a, b) with a <= b, a + b == target, and a and b at two different
    positions of `values`; no pair twice, sorted."""
''',
        '''\
    pairs = set()
    for i, a in enumerate(values):
        for b in values[i + 1:]:
            if a + b == target:
                pairs.add((min(a, b), max(a, b)))
    return sorted(pairs)
''',
        (
            'assert pairs_with_sum([1, 2, 3, 4, 5], 6) == [(1, 5), (2, 4)]',
            'assert pairs_with_sum([3, 3], 6) == [(3, 3)]',
            'assert pairs_with_sum([3], 6) == []',
            'assert pairs_with_sum([2, 4, 2, 4], 6) == [(2, 4)]',
        ),
    ),
    CodeTask(
        "median",
        '''\
def median(values: list[float]) -> float:
    """Return the median of a non-empty list of numbers as a float (the mean of the two middle
    values when there is an even number of them)."""
''',
        '''\
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
''',
        (
            'assert median([3, 1, 2]) == 2.0',
            'assert median([4, 1, 3, 2]) == 2.5',
            'assert median([7]) == 7.0',
            'assert median([1.5, -1.5]) == 0.0',
        ),
    ),
    CodeTask(
        "parse_duration",
        '''\
def parse_duration(text: str) -> int:
    """Return the seconds in a duration such as "1h30m", "45s" or "2h5s": numbers each followed
    by h, m or s, each unit at most once, in that order."""
''',
        '''\
    seconds = {'h': 3600, 'm': 60, 's': 1}
    total, number = 0, ''
    for ch in text:
        if ch.isdigit():
            number += ch
        else:
            total += int(number) * seconds[ch]
            number = ''
    return total
''',
        (
            "assert parse_duration('45s') == 45",
            "assert parse_duration('1h30m') == 5400",
            "assert parse_duration('2h5s') == 7205",
            "assert parse_duration('10m10s') == 610",
        ),
    ),
    CodeTask(
        "snake_to_camel",
        '''\
def snake_to_camel(name: str) -> str:
    """Turn a snake_case name into camelCase, e.g. "policy_version" -> "policyVersion"."""
''',
        '''\
    first, *rest = name.split('_')
    return first + ''.join(part.capitalize() for part in rest)
''',
        (
            "assert snake_to_camel('policy_version') == 'policyVersion'",
            "assert snake_to_camel('step') == 'step'",
            "assert snake_to_camel('max_off_policy_steps') == 'maxOffPolicySteps'",
        ),
    ),
    CodeTask(
        "camel_to_snake",
        '''\
def camel_to_snake(name: str) -> str:
    """Turn a camelCase name into snake_case, e.g. "policyVersion" -> "policy_version"."""
''',
        '''\
    return ''.join('_' + ch.lower() if ch.isupper() else ch for ch in name)
''',
        (
            "assert camel_to_snake('policyVersion') == 'policy_version'",
            "assert camel_to_snake('step') == 'step'",
            "assert camel_to_snake('maxOffPolicySteps') == 'max_off_policy_steps'",
        ),
    ),
    CodeTask(
        "max_subarray_sum",
        '''\
def max_subarray_sum(values: list[int]) -> int:
    """Return the largest sum of a non-empty run of consecutive items of the non-empty list
    `values`."""
''',
        '''\
    best = current = values[0]
    for v in values[1:]:
        current = max(v, current + v)
        best = max(best, current)
    return best
''',
        (
            'assert max_subarray_sum([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6',
            'assert max_subarray_sum([-3, -1, -2]) == -1',
            'assert max_subarray_sum([5]) == 5',
            'assert max_subarray_sum([1, 2, 3]) == 6',
        ),
    ),
    CodeTask(
        "is_leap_year",
        '''\
def is_leap_year(year: int) -> bool:
    """Return True if `year` is a leap year of the Gregorian calendar."""
''',
        '''\
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''',
        (
            'assert is_leap_year(2024) == True',
            'assert is_leap_year(2023) == False',
            'assert is_leap_year(1900) == False',
            'assert is_leap_year(2000) == True',
        ),
    ),
    CodeTask(
        "day_of_year",
        '''\
def day_of_year(year: int, month: int, day: int) -> int:
    """Return which day of its year a Gregorian date is (1 January is day 1), without importing
    anything."""
''',
        '''\
    lengths = [31, 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28, 31, 30, 31,
               30, 31, 31, 30, 31, 30, 31]
    return sum(lengths[:month - 1]) + day
''',
        (
            'assert day_of_year(2023, 1, 1) == 1',
            'assert day_of_year(2023, 3, 1) == 60',
            'assert day_of_year(2024, 3, 1) == 61',
            'assert day_of_year(2024, 12, 31) == 366',
        ),
    ),
    CodeTask(
        "compress_ranges",
        '''\
def compress_ranges(values: list[int]) -> str:
    """Write a sorted list of distinct integers with runs of three or more consecutive numbers
    as "first-last", comma-separated, e.g. [1, 2, 3, 5, 7, 8] -> "1-3,5,7,8"."""
''',
        '''\
    parts = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f'{values[i]}-{values[j]}')
        else:
            parts.extend(str(v) for v in values[i:j + 1])
        i = j + 1
    return ','.join(parts)
''',
        (
            "assert compress_ranges([1, 2, 3, 5, 7, 8]) == '1-3,5,7,8'",
            "assert compress_ranges([]) == ''",
            "assert compress_ranges([4]) == '4'",
            "assert compress_ranges([-2, -1, 0, 1]) == '-2-1'",
            "assert compress_ranges([1, 3, 4, 5, 6, 9]) == '1,3-6,9'",
        ),
    ),
    CodeTask(
        "expand_ranges",
        '''\
def expand_ranges(text: str) -> list[int]:
    """Expand comma-separated non-negative integers and inclusive ranges "a-b" into a list, e.g.
    "1-3,7" -> [1, 2, 3, 7]; an empty text gives []."""
''',
        '''\
    out = []
    for part in filter(None, text.split(',')):
        if '-' in part:
            a, b = part.split('-')
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out
''',
        (
            "assert expand_ranges('1-3,7') == [1, 2, 3, 7]",
            "assert expand_ranges('') == []",
            "assert expand_ranges('5') == [5]",
            "assert expand_ranges('0-0,2-4') == [0, 2, 3, 4]",
        ),
    ),
    CodeTask(
        "hamming_distance",
        '''\
def hamming_distance(a: str, b: str) -> int:
    """Return how many positions two strings of equal length differ at."""
''',
        '''\
    return sum(x != y for x, y in zip(a, b))
''',
        (
            "assert hamming_distance('', '') == 0",
            "assert hamming_distance('karolin', 'kathrin') == 3",
            "assert hamming_distance('abc', 'abc') == 0",
            "assert hamming_distance('0000', '1111') == 4",
        ),
    ),
    CodeTask(
        "is_prime",
        '''\
def is_prime(n: int) -> bool:
    """Return True if the integer `n` is a prime number."""
''',
        '''\
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True
''',
        (
            'assert is_prime(1) == False',
            'assert is_prime(2) == True',
            'assert is_prime(91) == False',
            'assert is_prime(97) == True',
            'assert is_prime(-7) == False',
        ),
    ),
    CodeTask(
        "matrix_multiply",
        '''\
def matrix_multiply(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """Return the matrix product a x b (the width of `a` equals the height of `b`)."""
''',
        '''\
    return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]
''',
        (
            'assert matrix_multiply([[1, 2], [3, 4]], [[5, 6], [7, 8]]) == [[19, 22], [43, 50]]',
            'assert matrix_multiply([[1, 0], [0, 1]], [[9, 8], [7, 6]]) == [[9, 8], [7, 6]]',
            'assert matrix_multiply([[2, 3]], [[4], [5]]) == [[23]]',
        ),
    ),
    CodeTask(
        "to_base",
        '''\
def to_base(n: int, base: int) -> str:
    """Write the non-negative integer `n` in `base` (2 to 36), using digits then lower-case
    letters."""
''',
        '''\
    digits = '0123456789abcdefghijklmnopqrstuvwxyz'
    if n == 0:
        return '0'
    out = []
    while n:
        n, r = divmod(n, base)
        out.append(digits[r])
    return ''.join(reversed(out))
''',
        (
            "assert to_base(0, 2) == '0'",
            "assert to_base(10, 2) == '1010'",
            "assert to_base(255, 16) == 'ff'",
            "assert to_base(35, 36) == 'z'",
            "assert to_base(100, 7) == '202'",
        ),
    ),
    CodeTask(
        "count_set_bits",
        '''\
def count_set_bits(n: int) -> int:
    """Return how many 1 bits the binary form of the non-negative integer `n` has."""
''',
        '''\
    count = 0
    while n:
        count += n & 1
        n >>= 1
    return count
''',
        (
            'assert count_set_bits(0) == 0',
            'assert count_set_bits(7) == 3',
            'assert count_set_bits(1024) == 1',
            'assert count_set_bits(2 ** 40 - 1) == 40',
        ),
    ),
    CodeTask(
        "interleave",
        '''\
def interleave(a: list, b: list) -> list:
    """Alternate the items of `a` and `b`, starting with `a`; the rest of the longer list follows."""
''',
        '''\
    out = []
    for i in range(max(len(a), len(b))):
        if i < len(a):
            out.append(a[i])
        if i < len(b):
            out.append(b[i])
    return out
''',
        (
            'assert interleave([1, 3, 5], [2, 4, 6]) == [1, 2, 3, 4, 5, 6]',
            'assert interleave([1], [2, 3, 4]) == [1, 2, 3, 4]',
            'assert interleave([], []) == []',
            "assert interleave(['a', 'b', 'c'], []) == ['a', 'b', 'c']",
        ),
    ),
    CodeTask(
        "window_maxima",
        '''\
def window_maxima(values: list[int], width: int) -> list[int]:
    """Return the maximum of every run of `width` consecutive items, from left to right."""
''',
        '''\
    return [max(values[i:i + width]) for i in range(len(values) - width + 1)]
''',
        (
            'assert window_maxima([1, 3, -1, -3, 5, 3, 6, 7], 3) == [3, 3, 5, 5, 6, 7]',
            'assert window_maxima([4, 2], 1) == [4, 2]',
            'assert window_maxima([4, 2], 2) == [4]',
            'assert window_maxima([1, 2], 3) == []',
        ),
    ),
    CodeTask(
        "title_words",
        '''\
def title_words(text: str) -> str:
    """Capitalize the first letter of every word and lower-case the rest; words are separated by
    single spaces."""
''',
        '''\
    return ' '.join(w[:1].upper() + w[1:].lower() for w in text.split(' '))
''',
        (
            "assert title_words('the GROUP size') == 'The Group Size'",
            "assert title_words('a') == 'A'",
            "assert title_words('') == ''",
            "assert title_words('x  y') == 'X  Y'",
        ),
    ),
    CodeTask(
        "mode_of",
        '''\
def mode_of(values: list[int]) -> int:
    """Return the most frequent value of the non-empty list `values`; on a tie, the smallest."""
''',
        '''\
    counts = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return min(counts, key=lambda v: (-counts[v], v))
''',
        (
            'assert mode_of([1, 2, 2, 3]) == 2',
            'assert mode_of([5]) == 5',
            'assert mode_of([4, 4, 1, 1]) == 1',
            'assert mode_of([-1, -1, 0]) == -1',
        ),
    ),
    CodeTask(
        "zip_to_dict",
        '''\
def zip_to_dict(keys: list[str], values: list[int]) -> dict[str, int]:
    """Pair keys with values in order; extra keys or values are dropped, and a repeated key keeps
    its last value."""
''',
        '''\
    return dict(zip(keys, values))
''',
        (
            "assert zip_to_dict(['a', 'b'], [1, 2]) == {'a': 1, 'b': 2}",
            "assert zip_to_dict(['a', 'b', 'c'], [1]) == {'a': 1}",
            'assert zip_to_dict([], [1, 2]) == {}',
            "assert zip_to_dict(['k', 'k'], [1, 2]) == {'k': 2}",
        ),
    ),
    CodeTask(
        "pascal_row",
        '''\
def pascal_row(n: int) -> list[int]:
    """Return row `n` of Pascal's triangle, row 0 being [1]."""
''',
        '''\
    row = [1]
    for _ in range(n):
        row = [a + b for a, b in zip([0] + row, row + [0])]
    return row
''',
        (
            'assert pascal_row(0) == [1]',
            'assert pascal_row(1) == [1, 1]',
            'assert pascal_row(4) == [1, 4, 6, 4, 1]',
            'assert sum(pascal_row(20)) == 1048576',
        ),
    ),
    CodeTask(
        "split_evens_odds",
        '''\
def split_evens_odds(values: list[int]) -> tuple[list[int], list[int]]:
    """Return (the even items, the odd items) of `values`, each in their original order."""
''',
        '''\
    return [v for v in values if v % 2 == 0], [v for v in values if v % 2]
''',
        (
            'assert split_evens_odds([1, 2, 3, 4]) == ([2, 4], [1, 3])',
            'assert split_evens_odds([]) == ([], [])',
            'assert split_evens_odds([-3, 0]) == ([0], [-3])',
            'assert split_evens_odds([7, 9]) == ([], [7, 9])',
        ),
    ),
    CodeTask(
        "longest_word",
        '''\
def longest_word(text: str) -> str:
    """Return the longest whitespace-separated word of `text` (the first one on a tie; "" if none)."""
''',
        '''\
    best = ''
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best
''',
        (
            "assert longest_word('the trainer publishes weights') == 'publishes'",
            "assert longest_word('ab cd') == 'ab'",
            "assert longest_word('   ') == ''",
            "assert longest_word('one') == 'one'",
        ),
    ),
    CodeTask(
        "digits_to_words",
        '''\
def digits_to_words(number: str) -> str:
    """Spell out each digit of a string of digits in English, separated by single spaces, e.g.
    "42" -> "four two"."""
''',
        '''\
    names = ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine']
    return ' '.join(names[int(d)] for d in number)
''',
        (
            "assert digits_to_words('42') == 'four two'",
            "assert digits_to_words('0') == 'zero'",
            "assert digits_to_words('') == ''",
            "assert digits_to_words('907') == 'nine zero seven'",
        ),
    ),
)
