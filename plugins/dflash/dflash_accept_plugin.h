/*
 * TensorRT IPluginV3 wrapper of the DFlash acceptance step: plugin `DFlashAccept`, version "1",
 * namespace `trtllm_dflash`. Inputs, outputs and attributes are documented in README.md.
 */
#pragma once

#include "NvInfer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace trtllm_dflash
{

constexpr char const* kPluginName = "DFlashAccept";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "trtllm_dflash";
constexpr char const* kBlockSizeField = "block_size";
constexpr char const* kMaskTokenIdField = "mask_token_id";

// Reports an error of a noexcept TensorRT method, which TensorRT only sees as a status code, as "<plugin>: message".
void logPluginError(std::string const& message, char const* plugin = kPluginName) noexcept;

class DFlashAcceptPlugin : public nvinfer1::IPluginV3,
                           public nvinfer1::IPluginV3OneCore,
                           public nvinfer1::IPluginV3OneBuild,
                           public nvinfer1::IPluginV3OneRuntime
{
public:
    // Throws std::invalid_argument for attributes the kernel cannot run (blockSize outside 2..4096).
    DFlashAcceptPlugin(int32_t blockSize, int32_t maskTokenId);
    DFlashAcceptPlugin(DFlashAcceptPlugin const& other);
    DFlashAcceptPlugin& operator=(DFlashAcceptPlugin const&) = delete;
    ~DFlashAcceptPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    // Why these 5 input shapes are wrong (empty when they fit): ranks, K = block_size - 1, one batch size and
    // one vocabulary. A negative dimension (a wildcard while building) matches anything.
    std::string shapeError(nvinfer1::Dims const* inputDims) const;

    // configurePlugin's and onShapeChange's check: logs why and returns -1 when the shapes are wrong.
    // inputDims(i) gives input i's Dims.
    template <typename InputDims>
    int32_t checkShapes(InputDims inputDims, int32_t nbInputs, int32_t nbOutputs) const noexcept;

    int32_t mBlockSize;
    int32_t mMaskTokenId;

    // getFieldsToSerialize returns pointers into these, so they live as long as the plugin.
    std::vector<nvinfer1::PluginField> mFieldsToSerialize;
    nvinfer1::PluginFieldCollection mCollectionToSerialize{};
};

class DFlashAcceptPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    DFlashAcceptPluginCreator();
    ~DFlashAcceptPluginCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

// Draft trees (README.md §Draft trees): plugin `DFlashTreeAccept`, version "1", same namespace, no attributes.
// Inputs target_logits [B, N, V], temperature [B], gumbel_noise [B, N, V], tree_parents [B, N], tree_tokens [B, N];
// outputs path_nodes [B, N], path_length [B], bonus [B] (int32).
constexpr char const* kTreePluginName = "DFlashTreeAccept";

class DFlashTreeAcceptPlugin : public nvinfer1::IPluginV3,
                               public nvinfer1::IPluginV3OneCore,
                               public nvinfer1::IPluginV3OneBuild,
                               public nvinfer1::IPluginV3OneRuntime
{
public:
    DFlashTreeAcceptPlugin() = default;
    ~DFlashTreeAcceptPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    // Why these 5 input shapes are wrong (empty when they fit); a negative dimension matches anything.
    static std::string shapeError(nvinfer1::Dims const* inputDims);

    template <typename InputDims>
    static int32_t checkShapes(InputDims inputDims, int32_t nbInputs, int32_t nbOutputs) noexcept;

    nvinfer1::PluginFieldCollection mNoFields{};
};

class DFlashTreeAcceptPluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;

private:
    nvinfer1::PluginFieldCollection mNoFields{};
};

} // namespace trtllm_dflash

// The library is built with hidden visibility (CMakeLists.txt); only TensorRT's entry points are exported.
// (NvInfer.h's TENSORRTAPI exports only inside TensorRT's own build.)
#if defined(_WIN32)
#define DFLASH_PLUGIN_EXPORT __declspec(dllexport)
#else
#define DFLASH_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

extern "C"
{
    // Entry points TensorRT looks up in a plugin library (IPluginRegistry::loadLibrary, trtexec
    // --dynamicPlugins, and version-compatible engines that embed the library).
    DFLASH_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
    DFLASH_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
}
