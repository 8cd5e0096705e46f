#include "checkpoint/pickle.h"

#include <cstring>
#include <map>

#include "core/error.h"

namespace mt {

const PickleValue* PickleValue::find(std::string_view key) const {
  const PickleValue* dict = this;
  if (kind == PickleKind::object) dict = state.get();
  if (!dict || dict->kind != PickleKind::dict) return nullptr;
  for (const auto& [k, v] : dict->entries)
    if (k->kind == PickleKind::string && k->text == key) return v.get();
  return nullptr;
}

const PickleValue& PickleValue::at(std::string_view key, std::string_view where) const {
  const PickleValue* v = find(key);
  if (!v) fail("{} has no '{}' (in a {})", where, key, describe());
  return *v;
}

std::string PickleValue::describe() const {
  switch (kind) {
    case PickleKind::none: return "None";
    case PickleKind::boolean: return "bool";
    case PickleKind::integer: return "int";
    case PickleKind::floating: return "float";
    case PickleKind::string: return "str";
    case PickleKind::bytes: return "bytes";
    case PickleKind::list: return "list";
    case PickleKind::tuple: return "tuple";
    case PickleKind::dict: return "dict";
    case PickleKind::set: return "set";
    case PickleKind::global: return "global " + text;
    case PickleKind::object: return text + " object";
    case PickleKind::persistent: return "persistent id";
  }
  return "?";
}

namespace {

PickleRef make(PickleKind k) {
  auto v = std::make_shared<PickleValue>();
  v->kind = k;
  return v;
}

class Unpickler {
 public:
  Unpickler(const unsigned char* data, size_t size, const std::string& where) : p_(data), end_(data + size), where_(where) {}

  PickleRef run() {
    while (true) {
      const unsigned char op = byte();
      switch (op) {
        case 0x80: byte(); break;       // PROTO
        case 0x95: bytes(8); break;     // FRAME (the length only guides buffering)
        case '.': return pop();         // STOP
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '0': pop(); break;         // POP
        case '1': pop_mark(); break;    // POP_MARK
        case '2': push(top()); break;   // DUP
        case 'N': push(make(PickleKind::none)); break;
        case 0x88: push_bool(true); break;   // NEWTRUE
        case 0x89: push_bool(false); break;  // NEWFALSE
        case 'J': push_int(static_cast<int32_t>(le(4))); break;  // BININT
        case 'K': push_int(static_cast<int64_t>(le(1))); break;  // BININT1
        case 'M': push_int(static_cast<int64_t>(le(2))); break;  // BININT2
        case 0x8a: push_long(static_cast<size_t>(le(1))); break; // LONG1
        case 0x8b: push_long(static_cast<size_t>(le(4))); break; // LONG4
        case 'I': push_text_int(line()); break;                  // INT ("I01\n" is True)
        case 'L': push_text_int(line()); break;                  // LONG ("123L\n")
        case 'G': push_float(bin_double()); break;               // BINFLOAT
        case 'F': push_float(std::stod(line())); break;          // FLOAT
        case 'X': push_text(PickleKind::string, le(4)); break;   // BINUNICODE
        case 0x8c: push_text(PickleKind::string, le(1)); break;  // SHORT_BINUNICODE
        case 0x8d: push_text(PickleKind::string, le(8)); break;  // BINUNICODE8
        case 'T': push_text(PickleKind::string, le(4)); break;   // BINSTRING (a Python 2 str)
        case 'U': push_text(PickleKind::string, le(1)); break;   // SHORT_BINSTRING
        case 'B': push_text(PickleKind::bytes, le(4)); break;    // BINBYTES
        case 'C': push_text(PickleKind::bytes, le(1)); break;    // SHORT_BINBYTES
        case 0x8e: push_text(PickleKind::bytes, le(8)); break;   // BINBYTES8
        case 0x96: push_text(PickleKind::bytes, le(8)); break;   // BYTEARRAY8
        case ']': push(make(PickleKind::list)); break;           // EMPTY_LIST
        case ')': push(make(PickleKind::tuple)); break;          // EMPTY_TUPLE
        case '}': push(make(PickleKind::dict)); break;           // EMPTY_DICT
        case 0x8f: push(make(PickleKind::set)); break;           // EMPTY_SET
        case 'l': push_sequence(PickleKind::list, pop_mark()); break;   // LIST
        case 't': push_sequence(PickleKind::tuple, pop_mark()); break;  // TUPLE
        case 0x91: push_sequence(PickleKind::set, pop_mark()); break;   // FROZENSET
        case 0x85: push_tuple(1); break;  // TUPLE1
        case 0x86: push_tuple(2); break;  // TUPLE2
        case 0x87: push_tuple(3); break;  // TUPLE3
        case 'd': {                       // DICT
          auto d = make(PickleKind::dict);
          set_items(*d, pop_mark());
          push(d);
          break;
        }
        case 'a': {  // APPEND
          PickleRef v = pop();
          append(top(), {v});
          break;
        }
        case 'e': case 0x90: {  // APPENDS, ADDITEMS
          std::vector<PickleRef> vs = pop_mark();
          append(top(), vs);
          break;
        }
        case 's': {  // SETITEM
          PickleRef v = pop(), k = pop();
          set_items(dict_target(top()), {k, v});
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<PickleRef> kv = pop_mark();
          set_items(dict_target(top()), kv);
          break;
        }
        case 'c': {  // GLOBAL "module\nname\n"
          std::string module = line();
          std::string name = line();
          push_global(module + "." + name);
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          PickleRef name = pop(), module = pop();
          if (!name->is(PickleKind::string) || !module->is(PickleKind::string)) bad("STACK_GLOBAL without two strings");
          push_global(module->text + "." + name->text);
          break;
        }
        case 'R': {  // REDUCE
          PickleRef args = pop(), callable = pop();
          push(call(callable, args));
          break;
        }
        case 0x81: {  // NEWOBJ cls(*args)
          PickleRef args = pop(), cls = pop();
          push(call(cls, args));
          break;
        }
        case 0x92: {  // NEWOBJ_EX cls(*args, **kwargs)
          PickleRef kwargs = pop(), args = pop(), cls = pop();
          PickleRef obj = call(cls, args);
          if (!kwargs->entries.empty()) obj->state = kwargs;
          push(obj);
          break;
        }
        case 'b': {  // BUILD
          PickleRef st = pop();
          PickleRef obj = top();
          // (state, slotstate) pairs: the dict part is what attributes live in.
          if (st->is(PickleKind::tuple) && st->items.size() == 2 && st->items[0]->is(PickleKind::none)) st = st->items[1];
          else if (st->is(PickleKind::tuple) && st->items.size() == 2 && st->items[0]->is(PickleKind::dict)) st = st->items[0];
          if (obj->is(PickleKind::dict) && st->is(PickleKind::dict)) {
            for (const auto& e : st->entries) obj->entries.push_back(e);
          } else {
            obj->state = st;
          }
          break;
        }
        case 'q': memo_[le(1)] = top(); break;         // BINPUT
        case 'r': memo_[le(4)] = top(); break;         // LONG_BINPUT
        case 'p': memo_[std::stoull(line())] = top(); break;  // PUT
        case 0x94: memo_[memo_.size()] = top(); break; // MEMOIZE
        case 'h': push(memo(le(1))); break;            // BINGET
        case 'j': push(memo(le(4))); break;            // LONG_BINGET
        case 'g': push(memo(std::stoull(line()))); break;  // GET
        case 'Q': {                                     // BINPERSID
          auto v = make(PickleKind::persistent);
          v->items.push_back(pop());
          push(v);
          break;
        }
        case 'P': {  // PERSID (a text id)
          auto id = make(PickleKind::string);
          id->text = line();
          auto v = make(PickleKind::persistent);
          v->items.push_back(id);
          push(v);
          break;
        }
        case 0x97: case 0x98: bad("out-of-band buffers (pickle protocol 5) are not supported");
        case 0x82: case 0x83: case 0x84: bad("extension registry codes are not supported");
        default: bad(fmt::format("unknown opcode 0x{:02x}", op));
      }
    }
  }

 private:
  [[noreturn]] void bad(const std::string& what) const {
    fail("{} is not a pickle megatrain can read: {} at byte {}", where_, what, pos());
  }
  size_t pos() const { return static_cast<size_t>(p_ - start_); }

  unsigned char byte() {
    if (p_ >= end_) bad("unexpected end of data");
    return *p_++;
  }
  const unsigned char* bytes(uint64_t n) {
    if (n > static_cast<uint64_t>(end_ - p_)) bad("a length past the end of the data");
    const unsigned char* b = p_;
    p_ += n;
    return b;
  }
  uint64_t le(int n) {
    const unsigned char* b = bytes(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | b[i];
    return v;
  }
  double bin_double() {  // big-endian IEEE double
    const unsigned char* b = bytes(8);
    uint64_t u = 0;
    for (int i = 0; i < 8; ++i) u = (u << 8) | b[i];
    double d;
    std::memcpy(&d, &u, 8);
    return d;
  }
  std::string line() {
    const unsigned char* s = p_;
    while (p_ < end_ && *p_ != '\n') ++p_;
    if (p_ >= end_) bad("a text argument without its newline");
    std::string out(reinterpret_cast<const char*>(s), static_cast<size_t>(p_ - s));
    ++p_;
    return out;
  }

  void push(PickleRef v) { stack_.push_back(std::move(v)); }
  PickleRef pop() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) bad("pop from an empty stack");
    PickleRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  const PickleRef& top() const {
    if (stack_.empty()) bad("empty stack");
    return stack_.back();
  }
  std::vector<PickleRef> pop_mark() {
    if (marks_.empty()) bad("no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PickleRef> out(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return out;
  }
  PickleRef memo(uint64_t key) const {
    auto it = memo_.find(key);
    if (it == memo_.end()) bad(fmt::format("memo key {} was never stored", key));
    return it->second;
  }

  void push_bool(bool b) {
    auto v = make(PickleKind::boolean);
    v->boolean = b;
    push(v);
  }
  void push_int(int64_t i) {
    auto v = make(PickleKind::integer);
    v->integer = i;
    push(v);
  }
  void push_long(size_t n) {  // little-endian two's complement of n bytes
    const unsigned char* b = bytes(n);
    if (n > 8) bad("an integer wider than 64 bits");
    uint64_t u = 0;
    for (size_t i = n; i-- > 0;) u = (u << 8) | b[i];
    if (n > 0 && n < 8 && (b[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);  // sign-extend
    push_int(static_cast<int64_t>(u));
  }
  void push_text_int(std::string s) {
    if (s == "00") return push_bool(false);
    if (s == "01") return push_bool(true);
    if (!s.empty() && s.back() == 'L') s.pop_back();
    push_int(std::stoll(s));
  }
  void push_float(double d) {
    auto v = make(PickleKind::floating);
    v->floating = d;
    push(v);
  }
  void push_text(PickleKind k, uint64_t n) {
    auto v = make(k);
    const unsigned char* b = bytes(n);
    v->text.assign(reinterpret_cast<const char*>(b), n);
    push(v);
  }
  void push_sequence(PickleKind k, std::vector<PickleRef> items) {
    auto v = make(k);
    v->items = std::move(items);
    push(v);
  }
  void push_tuple(size_t n) {
    if (stack_.size() < n + (marks_.empty() ? 0 : marks_.back())) bad("TUPLE of missing items");
    std::vector<PickleRef> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    push_sequence(PickleKind::tuple, std::move(items));
  }
  void push_global(std::string name) {
    auto v = make(PickleKind::global);
    v->text = std::move(name);
    push(v);
  }

  void append(const PickleRef& target, const std::vector<PickleRef>& vs) {
    if (!target->is(PickleKind::list) && !target->is(PickleKind::set)) {
      // list subclasses (rare) keep their items with the object
      if (!target->is(PickleKind::object)) bad("APPEND to a " + target->describe());
    }
    for (const auto& v : vs) target->items.push_back(v);
  }
  // SETITEM(S) target: a dict, or an object made by a dict subclass's constructor.
  PickleValue& dict_target(const PickleRef& t) {
    if (t->is(PickleKind::dict)) return *t;
    if (t->is(PickleKind::object)) {
      if (!t->state) t->state = make(PickleKind::dict);
      if (t->state->is(PickleKind::dict)) return *t->state;
    }
    bad("SETITEM on a " + t->describe());
  }
  void set_items(PickleValue& d, const std::vector<PickleRef>& kv) {
    if (kv.size() % 2) bad("SETITEMS with an odd number of items");
    for (size_t i = 0; i < kv.size(); i += 2) {
      bool replaced = false;
      if (kv[i]->is(PickleKind::string))
        for (auto& e : d.entries)
          if (e.first->is(PickleKind::string) && e.first->text == kv[i]->text) {
            e.second = kv[i + 1];
            replaced = true;
          }
      if (!replaced) d.entries.emplace_back(kv[i], kv[i + 1]);
    }
  }

  PickleRef call(const PickleRef& callable, const PickleRef& args) {
    if (!callable->is(PickleKind::global)) bad("a call of a " + callable->describe());
    if (!args->is(PickleKind::tuple)) bad("call arguments that are not a tuple");
    const std::string& name = callable->text;
    if (name == "collections.OrderedDict" && args->items.empty()) return make(PickleKind::dict);
    if (name == "_codecs.encode" && args->items.size() == 2 && args->items[0]->is(PickleKind::string)) {
      // Protocol 2's bytes: the text holds each byte as one code point, UTF-8 encoded here.
      auto b = make(PickleKind::bytes);
      const std::string& s = args->items[0]->text;
      for (size_t i = 0; i < s.size(); ++i) {
        const unsigned char c = static_cast<unsigned char>(s[i]);
        if (c < 0x80) {
          b->text.push_back(static_cast<char>(c));
        } else if ((c & 0xe0) == 0xc0 && i + 1 < s.size()) {
          b->text.push_back(static_cast<char>(((c & 0x1f) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3f)));
          ++i;
        } else {
          bad("_codecs.encode of text outside latin-1");
        }
      }
      return b;
    }
    auto obj = make(PickleKind::object);
    obj->text = name;
    obj->items = args->items;
    return obj;
  }

  const unsigned char* p_;
  const unsigned char* const end_;
  const unsigned char* const start_ = p_;
  const std::string& where_;
  std::vector<PickleRef> stack_;
  std::vector<size_t> marks_;
  std::map<uint64_t, PickleRef> memo_;
};

}  // namespace

PickleRef read_pickle(const unsigned char* data, size_t size, const std::string& where) {
  try {
    return Unpickler(data, size, where).run();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {  // a malformed number in a text opcode (std::stoll, std::stod)
    fail("{} is not a pickle megatrain can read: {}", where, e.what());
  }
}

}  // namespace mt
