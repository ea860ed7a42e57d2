// A gRPC load generator for `mmad bench --service --grpc-generator`: Triton's ModelInfer with raw
// input contents (what tritonclient.grpc sends), `clients` blocking clients on threads of their
// own, each a channel with a connection of its own (a local subchannel pool: gRPC's channels to one
// address share a connection by default, which a daemon's serving workers would answer as one
// client). Written in C++ because a Python gRPC client costs ~0.4 ms of CPU a call: on a host
// whose cores the daemon's workers and the generators share, the Python generators bounded the
// figure before the daemon did. Each reply's raw output is checked (size, finite) inside the
// clock. One JSON object on stdout: the keys of mmad.bench.load.summarize plus errors.
//
//   loadgen --target HOST:PORT --model NAME --clients N --rows-min A --rows-max B --datatype FP16|FP32
//           --n-in K --n-out M --duration-s S --warmup-s W --max-requests R --pool P --seed X
//           [--start-at UNIX_S] [--warmup-requests Q]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "grpc_service.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string target = "127.0.0.1:8001", model = "bench", datatype = "FP16";
  int clients = 8, rows_min = 1, rows_max = 16, n_in = 32, n_out = 16, pool = 16, warmup_requests = 0;
  long max_requests = 1000000;
  double duration_s = 5, warmup_s = 0, start_at = 0;
  unsigned seed = 1;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--target") o.target = v;
    else if (k == "--model") o.model = v;
    else if (k == "--datatype") o.datatype = v;
    else if (k == "--clients") o.clients = std::stoi(v);
    else if (k == "--rows-min") o.rows_min = std::stoi(v);
    else if (k == "--rows-max") o.rows_max = std::stoi(v);
    else if (k == "--n-in") o.n_in = std::stoi(v);
    else if (k == "--n-out") o.n_out = std::stoi(v);
    else if (k == "--pool") o.pool = std::stoi(v);
    else if (k == "--warmup-requests") o.warmup_requests = std::stoi(v);
    else if (k == "--max-requests") o.max_requests = std::stol(v);
    else if (k == "--duration-s") o.duration_s = std::stod(v);
    else if (k == "--warmup-s") o.warmup_s = std::stod(v);
    else if (k == "--start-at") o.start_at = std::stod(v);
    else if (k == "--seed") o.seed = static_cast<unsigned>(std::stoul(v));
    else { std::fprintf(stderr, "loadgen: unknown option %s\n", k.c_str()); std::exit(2); }
  }
  if (o.datatype != "FP16" && o.datatype != "FP32") { std::fprintf(stderr, "loadgen: --datatype FP16 or FP32\n"); std::exit(2); }
  return o;
}

uint16_t to_half(float f) {  // round to nearest even; the inputs are in [-1, 1]: no overflow
  uint32_t x; std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
  if (exp < 103) return static_cast<uint16_t>(sign);  // below half's subnormals
  if (exp < 113) {  // a half subnormal
    mant |= 0x800000;
    int shift = 126 - exp;
    uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) half++;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((exp - 112) << 10) | (mant >> 13), rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
  return static_cast<uint16_t>(sign | half);
}

bool all_finite(const std::string& raw, bool fp16) {
  if (fp16) {
    const auto* p = reinterpret_cast<const uint16_t*>(raw.data());
    for (size_t i = 0, n = raw.size() / 2; i < n; ++i) if ((p[i] & 0x7c00) == 0x7c00) return false;
  } else {
    const auto* p = reinterpret_cast<const float*>(raw.data());
    for (size_t i = 0, n = raw.size() / 4; i < n; ++i) if (!std::isfinite(p[i])) return false;
  }
  return true;
}

struct Shared {
  std::atomic<bool> stop{false};
  std::atomic<long> measured{0}, completed{0};
  std::mutex lock;
  std::vector<double> latencies;
  double first_begin = 1e300, last_end = 0;
  long rows = 0, bytes = 0;
  std::map<std::string, long> errors;
  std::string first_error;

  void fail(const std::string& kind, const std::string& detail) {
    std::lock_guard<std::mutex> g(lock);
    errors[kind]++;
    if (first_error.empty()) first_error = detail.substr(0, 300);
  }
};

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') { out += '\\'; out += c; }
    else if (static_cast<unsigned char>(c) < 0x20) { char buf[8]; std::snprintf(buf, sizeof buf, "\\u%04x", c); out += buf; }
    else out += c;
  }
  return out + "\"";
}

double percentile(std::vector<double> v, double q) {  // numpy's default (linear) percentile
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  double pos = q / 100.0 * (v.size() - 1);
  size_t lo = static_cast<size_t>(pos), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - lo);
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  bool fp16 = o.datatype == "FP16";
  size_t item = fp16 ? 2 : 4;
  std::mt19937 rng(o.seed);
  std::uniform_real_distribution<float> value(-1.f, 1.f);
  std::uniform_int_distribution<int> row_count(o.rows_min, o.rows_max);
  std::vector<inference::ModelInferRequest> pool(o.pool);
  std::vector<int> pool_rows(o.pool);
  for (int k = 0; k < o.pool; ++k) {  // fresh random data, built before the clock starts
    int rows = row_count(rng);
    pool_rows[k] = rows;
    auto& r = pool[k];
    r.set_model_name(o.model);
    auto* in = r.add_inputs();
    in->set_name("INPUT");
    in->set_datatype(o.datatype);
    in->add_shape(rows);
    in->add_shape(o.n_in);
    auto* out = r.add_outputs();
    out->set_name("OUTPUT");
    (*out->mutable_parameters())["output_datatype"].set_string_param(o.datatype);  // mmad's: outputs in the inputs' datatype
    std::string raw(static_cast<size_t>(rows) * o.n_in * item, '\0');
    for (size_t i = 0, n = static_cast<size_t>(rows) * o.n_in; i < n; ++i) {
      float f = value(rng);
      if (fp16) { uint16_t h = to_half(f); std::memcpy(&raw[i * 2], &h, 2); }
      else std::memcpy(&raw[i * 4], &f, 4);
    }
    r.add_raw_input_contents(std::move(raw));
  }

  std::vector<std::unique_ptr<inference::GRPCInferenceService::Stub>> stubs;
  for (int c = 0; c < o.clients; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(1 << 30);
    args.SetMaxSendMessageSize(1 << 30);
    args.SetInt("grpc.use_local_subchannel_pool", 1);  // a connection of its own
    auto channel = grpc::CreateCustomChannel(o.target, grpc::InsecureChannelCredentials(), args);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(30))) {
      std::fprintf(stderr, "loadgen: could not connect to %s\n", o.target.c_str());
      return 1;
    }
    stubs.push_back(inference::GRPCInferenceService::NewStub(channel));
  }
  if (o.start_at > 0) {  // several generator processes time the same window
    double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    if (o.start_at > now) std::this_thread::sleep_for(std::chrono::duration<double>(o.start_at - now));
  }
  Shared shared;
  auto start = Clock::now();
  auto seconds = [&](Clock::time_point t) { return std::chrono::duration<double>(t - start).count(); };
  double t0 = o.warmup_s, deadline = o.warmup_s + o.duration_s;

  std::vector<std::thread> threads;
  for (int c = 0; c < o.clients; ++c) {
    threads.emplace_back([&, c] {
      long k = static_cast<long>(c) * 7919, sent = 0;
      std::vector<double> mine;
      double first = 1e300, last = 0;
      long rows = 0, bytes = 0;
      while (!shared.stop.load(std::memory_order_relaxed)) {
        const auto& request = pool[k % o.pool];
        int n = pool_rows[k % o.pool];
        ++k;
        inference::ModelInferResponse reply;
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        double began = seconds(Clock::now());
        grpc::Status status = stubs[c]->ModelInfer(&context, request, &reply);
        double ended = seconds(Clock::now());
        if (!status.ok()) {
          shared.fail("StatusCode." + std::to_string(status.error_code()), status.error_message());
          if (ended >= deadline) shared.stop = true;
          continue;
        }
        ++sent;
        shared.completed++;
        const std::string empty;
        const std::string& raw = reply.raw_output_contents_size() ? reply.raw_output_contents(0) : empty;
        if (raw.size() != static_cast<size_t>(n) * o.n_out * item || !all_finite(raw, fp16)) {
          shared.fail("wrong output", std::to_string(raw.size() / item) + " values for " + std::to_string(n) + " rows");
        } else if (began >= t0 && sent > o.warmup_requests) {
          mine.push_back(ended - began);
          rows += n;
          bytes += static_cast<long>(request.raw_input_contents(0).size() + raw.size());
          first = std::min(first, began);
          last = std::max(last, ended);
          if (shared.measured.fetch_add(1) + 1 >= o.max_requests) shared.stop = true;
        }
        if (ended >= deadline) shared.stop = true;
      }
      std::lock_guard<std::mutex> g(shared.lock);
      shared.latencies.insert(shared.latencies.end(), mine.begin(), mine.end());
      shared.first_begin = std::min(shared.first_begin, first);
      shared.last_end = std::max(shared.last_end, last);
      shared.rows += rows;
      shared.bytes += bytes;
    });
  }
  for (auto& t : threads) t.join();

  double window = std::max(shared.last_end - std::min(shared.first_begin, shared.last_end), 1e-9);
  size_t done = shared.latencies.size();
  std::vector<double> ms(shared.latencies);
  double mean = 0;
  for (auto& v : ms) { v *= 1e3; mean += v; }
  mean = done ? mean / done : NAN;
  std::string errors = "{";
  for (const auto& [kind, n] : shared.errors) errors += (errors.size() > 1 ? ", " : "") + json_string(kind) + ": " + std::to_string(n);
  errors += "}";
  auto num = [](double v) { return std::isfinite(v) ? std::to_string(v) : std::string("NaN"); };
  std::printf("{\"requests\": %zu, \"window_s\": %.3f, \"requests_per_s\": %s, \"samples_per_s\": %s, "
              "\"mb_per_s\": %s, \"p50_ms\": %s, \"p90_ms\": %s, \"p99_ms\": %s, \"mean_ms\": %s, \"errors\": %s, "
              "\"first_error\": %s, \"elapsed_s\": %.3f, \"completed\": %ld}\n",
              done, window, num(done / window).c_str(), num(shared.rows / window).c_str(),
              num(shared.bytes / window / 1e6).c_str(), num(percentile(ms, 50)).c_str(), num(percentile(ms, 90)).c_str(),
              num(percentile(ms, 99)).c_str(), num(mean).c_str(), errors.c_str(),
              shared.first_error.empty() ? "null" : json_string(shared.first_error).c_str(),
              seconds(Clock::now()), shared.completed.load());
  return 0;
}
